// The redistribute planner and executor (NOTE: [Plans priced as they run]):
// golden plans on 1-D and 2-D meshes, their cost as the sum of their steps',
// plans kept by the decision cache and by redistribute(), and values through
// the executor against one device in float64, with the collectives that ran
// counted against the plan's collective steps.
#include "dist.h"
#include "dtensor/redistribute.h"
#include "dtensor/sharding_prop.h"
#include "dtp/comm_counter.h"
#include "dtp/device_mesh.h"
#include "dtp/dtensor.h"
#include "mesh/fake_mesh.h"
#include "rule_golden.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>

#include <algorithm>

using namespace dtp;
using dtp::test::run_ranks;

namespace {

// A placement from its compact text: "R", "S(1)", "P(sum)", "P(max)".
Placement placementOf(const std::string& text) {
  if (text == "R") return Replicate();
  if (text[0] == 'S') return Shard(std::stoll(text.substr(2)));
  return Partial(text == "P(max)" ? ReduceOp::Max : ReduceOp::Sum);
}

// The plan for f32[8,16] (128 elements) from `src` to `dst` on a fake mesh.
RedistributePlan planOn(const std::vector<int64_t>& mesh_shape, const Placements& src, const Placements& dst) {
  const DeviceMesh mesh = make_fake_device_mesh(mesh_shape, std::vector<int64_t>(mesh_shape.size(), 0));
  return plan_redistribute(*make_spec(mesh, src, {8, 16}, at::kFloat), dst);
}

double stepCostSum(const RedistributePlan& plan) {
  double sum = 0;
  for (const auto& s : plan) sum += s.cost;
  return sum;
}

TEST(RedistributePlanTest, GoldenPlansOneDimMesh) {
  // n = 128 elements on 4 ranks: all_gather n*3, all_to_all and
  // reduce_scatter n*3/4, all_reduce 2n*3/4, local n/1000.
  const std::vector<std::tuple<Placements, Placements, std::string, double>> cases = {
      {{Shard(0)}, {Replicate()}, "S(0) -> R: [dim0 S(0)->R all_gather]", 384},
      {{Replicate()}, {Shard(1)}, "R -> S(1): [dim0 R->S(1) local]", 0.128},
      {{Shard(0)}, {Shard(1)}, "S(0) -> S(1): [dim0 S(0)->S(1) all_to_all]", 96},
      {{Partial()}, {Replicate()}, "P(sum) -> R: [dim0 P(sum)->R all_reduce]", 192},
      {{Partial()}, {Shard(0)}, "P(sum) -> S(0): [dim0 P(sum)->S(0) reduce_scatter]", 96},
      {{Replicate()}, {Partial()}, "R -> P(sum): [dim0 R->P(sum) local]", 0.128},
      {{Partial()}, {Partial(ReduceOp::Max)},
       "P(sum) -> P(max): [dim0 P(sum)->R all_reduce, dim0 R->P(max) local]", 192.128},
      {{Shard(0)}, {Shard(0)}, "S(0) -> S(0): []", 0},
  };
  for (const auto& [src, dst, golden, cost] : cases) {
    const RedistributePlan plan = planOn({4}, src, dst);
    EXPECT_EQ(plan.str(), golden);
    EXPECT_DOUBLE_EQ(plan.cost, cost) << golden;
    EXPECT_DOUBLE_EQ(plan.cost, stepCostSum(plan)) << golden;
  }
}

TEST(RedistributePlanTest, GoldenPlansTwoDimMesh) {
  // (2,2): all_gather n, all_reduce n, local n/1000; shards nest in mesh
  // order (NOTE: [Redistribute order]), so S(0)S(0) -> RS(0) gathers both
  // mesh dims where each mesh dim priced alone (dim 0 S(0)->R, dim 1 kept)
  // would say one all_gather.
  const std::vector<std::tuple<Placements, Placements, std::string, double>> cases = {
      {{Shard(0), Shard(0)}, {Replicate(), Shard(0)},
       "S(0)S(0) -> RS(0): [dim1 S(0)->R all_gather, dim0 S(0)->R all_gather, dim1 R->S(0) local]", 256.128},
      {{Shard(0), Shard(1)}, {Shard(1), Shard(0)},
       "S(0)S(1) -> S(1)S(0): [dim1 S(1)->R all_gather, dim0 S(0)->R all_gather, dim0 R->S(1) local, "
       "dim1 R->S(0) local]",
       256.256},
      {{Shard(0), Replicate()}, {Replicate(), Shard(0)},
       "S(0)R -> RS(0): [dim0 S(0)->R all_gather, dim1 R->S(0) local]", 128.128},
      {{Partial(), Shard(0)}, {Replicate(), Replicate()},
       "P(sum)S(0) -> RR: [dim1 S(0)->R all_gather, dim0 P(sum)->R all_reduce]", 256},
      {{Replicate(), Shard(1)}, {Shard(0), Shard(1)}, "RS(1) -> S(0)S(1): [dim0 R->S(0) local]", 0.128},
      {{Shard(0), Shard(1)}, {Shard(0), Replicate()}, "S(0)S(1) -> S(0)R: [dim1 S(1)->R all_gather]", 128},
  };
  for (const auto& [src, dst, golden, cost] : cases) {
    const RedistributePlan plan = planOn({2, 2}, src, dst);
    EXPECT_EQ(plan.str(), golden);
    EXPECT_DOUBLE_EQ(plan.cost, cost) << golden;
    EXPECT_DOUBLE_EQ(plan.cost, stepCostSum(plan)) << golden;
  }
  // A one-rank mesh dim moves no data: its steps are local.
  const RedistributePlan plan = planOn({1, 2}, {Shard(0), Replicate()}, {Replicate(), Shard(0)});
  EXPECT_EQ(plan.str(), "S(0)R -> RS(0): [dim0 S(0)->R local, dim1 R->S(0) local]");
  EXPECT_DOUBLE_EQ(plan.cost, 0.256);
}

// Candidates are priced by the plans that run. On a (2,2) mesh, mul of
// f32[5,7] S(1)S(1) by S(0)R: each mesh dim priced alone made both rows
// S(0) on dim 0 look like one all_to_all (17.5) and chose S(0)S(1) for
// both inputs, but S(1)S(1) -> S(0)S(1) cannot all_to_all under the nested
// dim-1 shard: its plan gathers both mesh dims (70.07). Moving the other
// input instead, S(0)R -> S(1)S(1), is one all_gather (35.07).
TEST(RedistributePlanTest, CandidatesArePricedByTheirPlans) {
  dtp::test::RuleGolden g22({2, 2});
  EXPECT_EQ(g22.propagate("aten::mul.Tensor", {g22.t("f32[5,7](S(1)S(1))"), g22.t("f32[5,7](S(0)R)")}),
            "S(1)S(1), S(1)S(1) -> f32[5,7](S(1)S(1))");
  EXPECT_EQ(planOn({2, 2}, {Shard(1), Shard(1)}, {Shard(0), Shard(1)}).str(),
            "S(1)S(1) -> S(0)S(1): [dim1 S(1)->R all_gather, dim0 S(1)->R all_gather, dim0 R->S(0) local, "
            "dim1 R->S(1) local]");
  // The decision keeps each input's plan: what the fallback runs on a hit.
  const at::Tensor a = g22.t("f32[5,7](S(1)S(1))"), b = g22.t("f32[5,7](S(0)R)");
  const auto& mul = c10::Dispatcher::singleton().findSchemaOrThrow("aten::mul", "Tensor");
  std::vector<c10::IValue> args{a, b};
  OpCall call{mul, args, {}, {}, 0};
  fill_slots(call);
  const PlannedDecision& d = propagate(call);
  ASSERT_EQ(d.in_plans.size(), 2u);
  EXPECT_EQ(d.in_plans[0].str(), "S(1)S(1) -> S(1)S(1): []");
  EXPECT_EQ(d.in_plans[1].str(), "S(0)R -> S(1)S(1): [dim0 S(0)->R all_gather, dim0 R->S(1) local, dim1 R->S(1) local]");
  EXPECT_DOUBLE_EQ(d.in_plans[1].cost, 5 * 7 + 2 * 0.035);
}

// Rows making more than kMaxPricedCandidates candidates are priced one mesh
// dim at a time: add on a 16-dim tensor has 18 rows per mesh dim (R, 16
// shards, P(sum)), 18^3 candidates on (2,2,2). Pricing them all would plan
// hundreds of targets before reaching the inputs' own placements; one dim
// at a time plans at most 3 dims x 18 rows x 2 inputs.
TEST(RedistributePlanTest, ManyCandidatesArePricedOneMeshDimAtATime) {
  dtp::test::RuleGolden g222({2, 2, 2});
  const std::string shape = "[2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2]";
  ASSERT_GT(18 * 18 * 18, static_cast<int>(kMaxPricedCandidates));
  clear_propagation_cache();
  const RedistributePlanStats s0 = redistribute_plan_stats();
  EXPECT_EQ(g222.propagate("aten::add.Tensor", {g222.t("f32" + shape + "(S(0)S(1)S(2))"),
                                                g222.t("f32" + shape + "(S(0)RS(2))")}),
            "S(0)S(1)S(2), S(0)S(1)S(2) -> f32" + shape + "(S(0)S(1)S(2))");
  const int64_t planned = redistribute_plan_stats().planned - s0.planned;
  EXPECT_GT(planned, 0);
  EXPECT_LE(planned, 3 * 18 * 2);
}

TEST(RedistributePlanTest, CachedPlanIsPlannedOnce) {
  const DeviceMesh mesh = make_fake_device_mesh({2, 2}, {0, 1});
  const auto spec = make_spec(mesh, {Shard(0), Shard(0)}, {8, 16}, at::kFloat);
  clear_redistribute_plan_cache();
  const RedistributePlanStats before = redistribute_plan_stats();
  const std::string first = cached_plan(*spec, {Replicate(), Shard(0)}).str();
  const std::string second = cached_plan(*spec, {Replicate(), Shard(0)}).str();
  // Another mesh of the same shape and a tensor of the same size share it.
  const DeviceMesh other = make_fake_device_mesh({2, 2}, {1, 0});
  cached_plan(*make_spec(other, {Shard(0), Shard(0)}, {16, 8}, at::kDouble), {Replicate(), Shard(0)});
  const RedistributePlanStats after = redistribute_plan_stats();
  EXPECT_EQ(first, second);
  EXPECT_EQ(after.planned - before.planned, 1);
  EXPECT_EQ(after.cache_hits - before.cache_hits, 2);
  EXPECT_EQ(after.cache_size, 1);
}

// A cache hit runs the decision's plans: nothing is planned again, and the
// collectives are those of the first call.
TEST(RedistributePlanTest, CachedDecisionRunsItsPlanWithoutPlanning) {
  const at::Tensor a = at::arange(24, at::kDouble).reshape({6, 4});
  const at::Tensor b = at::arange(24, at::kDouble).reshape({6, 4}) * 10 + 1;
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    const at::Tensor x = distribute_tensor(a, mesh, {Shard(0)});
    // S(0) + S(1): the S(1) input moves by one all_to_all; S(0) + R: the R
    // input is chunked locally.
    for (const auto& [other, collectives] : {std::pair{Placement(Shard(1)), int64_t{1}},
                                             std::pair{Placement(Replicate()), int64_t{0}}}) {
      const at::Tensor y = distribute_tensor(b, mesh, {other});
      clear_propagation_cache();
      for (int call = 0; call < 3; ++call) {
        const RedistributePlanStats s0 = redistribute_plan_stats();
        const PropagationCacheStats p0 = propagation_cache_stats();
        CommCounter comm;
        const at::Tensor sum = at::add(x, y);
        const RedistributePlanStats s1 = redistribute_plan_stats();
        const PropagationCacheStats p1 = propagation_cache_stats();
        EXPECT_EQ(comm.total_count(), collectives) << other << ", call " << call << ": " << comm.str();
        EXPECT_EQ(p1.hits - p0.hits, call == 0 ? 0 : 1) << other << ", call " << call;
        if (call == 0) EXPECT_GT(s1.planned - s0.planned, 0) << "a miss prices its candidates by their plans";
        else EXPECT_EQ(s1.planned - s0.planned, 0) << other << ", call " << call << ": a hit plans nothing";
        EXPECT_EQ(dtensor_spec(sum).placements, Placements{Shard(0)});
        EXPECT_EQ((full_tensor(sum) - (a + b)).abs().max().item<double>(), 0) << other << ", call " << call;
      }
    }
  });
}

// redistribute() takes its plan from this thread's plan cache: planned on
// the first call only.
TEST(RedistributePlanTest, RedistributeCachesItsPlan) {
  const at::Tensor a = at::arange(35, at::kDouble).reshape({7, 5});
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    const at::Tensor x = distribute_tensor(a, mesh, {Shard(0)});
    clear_redistribute_plan_cache();
    for (int call = 0; call < 3; ++call) {
      const RedistributePlanStats s0 = redistribute_plan_stats();
      CommCounter comm;
      const at::Tensor y = redistribute(x, mesh, {Shard(1)});
      const RedistributePlanStats s1 = redistribute_plan_stats();
      EXPECT_EQ(comm.count(CollectiveType::AllToAll), 1) << comm.str();
      EXPECT_EQ(comm.total_count(), 1) << comm.str();
      EXPECT_EQ(s1.planned - s0.planned, call == 0 ? 1 : 0) << "call " << call;
      EXPECT_EQ(s1.cache_hits - s0.cache_hits, call == 0 ? 0 : 1) << "call " << call;
      EXPECT_EQ((full_tensor(y) - a).abs().max().item<double>(), 0) << "call " << call;
    }
  });
}

// This rank's shard of `full` under `placements` (no Partial), computed
// directly: each mesh dim, in order, chunks what the ones before it left.
at::Tensor shardOf(const at::Tensor& full, const DeviceMesh& mesh, const Placements& placements) {
  const auto coord = mesh.get_coordinate();
  at::Tensor t = full;
  for (size_t m = 0; m < placements.size(); ++m) {
    if (!placements[m].is_shard()) continue;
    const int64_t d = placements[m].dim, n = mesh.size(static_cast<int64_t>(m));
    t = t.narrow(d, chunk_start(t.size(d), n, coord[m]), chunk_size(t.size(d), n, coord[m]));
  }
  return t;
}

// A local value for `placements`, Partial(sum) included: on each P(sum)
// mesh dim, coordinate 0 holds the shard less (n-1)*3 and the others 3,
// which sum back exactly in float64.
at::Tensor localOf(const at::Tensor& full, const DeviceMesh& mesh, const Placements& placements) {
  Placements unreduced = placements;
  for (auto& p : unreduced)
    if (p.is_partial()) p = Replicate();
  at::Tensor t = shardOf(full, mesh, unreduced).clone();
  const auto coord = mesh.get_coordinate();
  for (size_t m = 0; m < placements.size(); ++m) {
    if (!placements[m].is_partial()) continue;
    const int64_t n = mesh.size(static_cast<int64_t>(m));
    t = coord[m] == 0 ? t - 3.0 * static_cast<double>(n - 1) : at::full_like(t, 3.0);
  }
  return t;
}

// Every source in {R, S(0), S(1), P(sum)} per mesh dim to every target in
// {R, S(0), S(1)} per mesh dim, through plan_redistribute and the executor:
// the local result is the target's shard of the one-device tensor exactly,
// and the collectives that ran are the plan's collective steps.
void checkEveryPair(const std::vector<int64_t>& mesh_shape, const std::vector<std::vector<int64_t>>& shapes) {
  const int world = static_cast<int>(c10::multiply_integers(mesh_shape));
  run_ranks(world, [&](int) {
    auto mesh = init_device_mesh("cpu", mesh_shape);
    const std::vector<Placement> sources{Replicate(), Shard(0), Shard(1), Partial()};
    auto all = [&](size_t kinds) {
      std::vector<Placements> out{{}};
      for (size_t m = 0; m < mesh_shape.size(); ++m) {
        std::vector<Placements> next;
        for (const auto& p : out)
          for (size_t k = 0; k < kinds; ++k) {
            next.push_back(p);
            next.back().push_back(sources[k]);
          }
        out = std::move(next);
      }
      return out;
    };
    for (const auto& shape : shapes) {
      const at::Tensor full = at::arange(c10::multiply_integers(shape), at::kDouble).reshape(shape);
      for (const auto& src : all(4)) {
        const auto spec = make_spec(mesh, src, shape, at::kDouble);
        const at::Tensor local = localOf(full, mesh, src);
        for (const auto& dst : all(3)) {
          const RedistributePlan plan = plan_redistribute(*spec, dst);
          int64_t planned_collectives = 0;
          for (const auto& step : plan) planned_collectives += step.collective.has_value();
          CommCounter comm;
          const at::Tensor out = run_redistribute(local, *spec, plan);
          const std::string what = c10::str(c10::IntArrayRef(shape), " ", plan.str());
          // A collective empty on every rank of its group is skipped (NOTE:
          // [Zero-size collectives]); only a dim shorter than the ranks can
          // make one.
          if (*std::min_element(shape.begin(), shape.end()) >= world)
            EXPECT_EQ(comm.total_count(), planned_collectives) << what << ": " << comm.str();
          else
            EXPECT_LE(comm.total_count(), planned_collectives) << what << ": " << comm.str();
          const at::Tensor want = shardOf(full, mesh, dst);
          ASSERT_EQ(out.sizes(), want.sizes()) << what;
          EXPECT_EQ(out.numel() == 0 ? 0.0 : (out - want).abs().max().item<double>(), 0) << what;
        }
      }
    }
  });
}

// 4k, 4k+1, 4k+3 and fewer rows than ranks.
TEST(RedistributePlanTest, ExecutorMatchesOneDeviceOnOneDimMesh) {
  checkEveryPair({4}, {{8, 12}, {9, 5}, {7, 3}, {3, 2}});
}

TEST(RedistributePlanTest, ExecutorMatchesOneDeviceOnTwoDimMesh) {
  checkEveryPair({2, 2}, {{8, 4}, {5, 7}, {3, 1}});
}

}  // namespace
