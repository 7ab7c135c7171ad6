// DTensor core: specs, redistribute plans (golden, no communication), every
// transition forward and backward with exact collective counts, and the API.
#include "close.h"
#include "dist.h"
#include "dtensor/redistribute.h"
#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

using namespace dtp;
using dtp::test::run_ranks;

namespace {

std::string plan(const DTensorSpec& src, const Placements& dst) {
  std::string s;
  for (const auto& st : plan_redistribute(src, dst))
    s += (s.empty() ? "" : " ") + std::to_string(st.mesh_dim) + ":" + st.from.str() + "->" + st.to.str();
  return s;
}

TEST(DTensorSpecTest, LocalShapesFollowTorchChunk) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {4});
    auto spec = make_spec(mesh, {Shard(0)}, {5, 10}, at::kFloat);
    const std::vector<int64_t> rows = {2, 2, 1, 0}, starts = {0, 2, 4, 5};
    EXPECT_EQ(spec->local_sizes, (std::vector<int64_t>{rows[rank], 10}));
    EXPECT_EQ(spec->local_offset(), (std::vector<int64_t>{starts[rank], 0}));
    EXPECT_EQ(spec->str(), "f32[5,10](S(0))");
  });
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    // Nested: mesh dim 0 splits 7 rows 4/3, mesh dim 1 splits each again.
    auto spec = make_spec(mesh, {Shard(0), Shard(0)}, {7, 2}, at::kDouble);
    const std::vector<int64_t> rows = {2, 2, 2, 1}, starts = {0, 2, 4, 6};
    EXPECT_EQ(spec->local_sizes[0], rows[rank]);
    EXPECT_EQ(spec->local_offset()[0], starts[rank]);
    EXPECT_EQ(make_spec(mesh, {Shard(1), Partial()}, {8, 16}, at::kBFloat16)->str(),
              "bf16[8,16](S(1)P(sum))");
  });
}

TEST(RedistributePlanTest, GoldenPlans) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    auto spec = [&](Placements p) { return *make_spec(mesh, p, {8, 8}, at::kFloat); };
    EXPECT_EQ(plan(spec({Shard(0), Replicate()}), {Replicate(), Replicate()}), "0:S(0)->R");
    EXPECT_EQ(plan(spec({Partial(), Shard(1)}), {Shard(0), Shard(1)}), "0:P(sum)->S(0)");
    EXPECT_EQ(plan(spec({Shard(0), Shard(1)}), {Shard(1), Shard(0)}),
              "1:S(1)->R 0:S(0)->R 0:R->S(1) 1:R->S(0)");
    // S(0)S(0) -> R S(0): mesh dim 1's shard is nested in mesh dim 0's, so
    // both are gathered before mesh dim 1 shards the rows again.
    EXPECT_EQ(plan(spec({Shard(0), Shard(0)}), {Replicate(), Shard(0)}),
              "1:S(0)->R 0:S(0)->R 1:R->S(0)");
    EXPECT_EQ(plan(spec({Shard(0), Replicate()}), {Shard(1), Replicate()}), "0:S(0)->S(1)");
    EXPECT_EQ(plan(spec({Replicate(), Replicate()}), {Partial(), Shard(0)}),
              "0:R->P(sum) 1:R->S(0)");
  });
}

// Builds a DTensor with placements `p` whose full value is `full`; Partial
// values are split unevenly across ranks so that only their sum is `full`.
at::Tensor makeWith(const at::Tensor& full, const DeviceMesh& mesh, const Placements& p) {
  Placements base;
  for (const auto& x : p) base.push_back(x.is_partial() ? Replicate() : x);
  at::Tensor t = distribute_tensor(full, mesh, base);
  at::Tensor local = to_local(t).clone();
  for (size_t m = 0; m < p.size(); ++m) {
    if (!p[m].is_partial()) continue;
    const int64_t k = mesh.get_coordinate()[m], n = mesh.size(m);
    // piece k: full * (k+1) / sum(1..n)
    local = local * (double(k + 1) / (n * (n + 1) / 2.0));
  }
  return from_local(local, mesh, p, false, full.sizes().vec());
}

struct Transition {
  Placement from, to;
  CollectiveType coll;
  int count;
};

class RedistributeTest : public ::testing::TestWithParam<int> {};

TEST_P(RedistributeTest, EveryTransitionUnevenForwardAndBackward) {
  const int w = GetParam();
  const std::vector<Transition> cases = {
      {Shard(0), Replicate(), CollectiveType::AllGather, 1},
      {Shard(1), Replicate(), CollectiveType::AllGather, 1},
      {Partial(), Replicate(), CollectiveType::AllReduce, 1},
      {Partial(), Shard(0), CollectiveType::ReduceScatter, 1},
      {Partial(), Shard(1), CollectiveType::ReduceScatter, 1},
      {Replicate(), Shard(0), CollectiveType::AllGather, 0},
      {Replicate(), Shard(1), CollectiveType::AllGather, 0},
      {Shard(0), Shard(1), CollectiveType::AllToAll, 1},
      {Shard(1), Shard(0), CollectiveType::AllToAll, 1},
      {Replicate(), Partial(), CollectiveType::AllReduce, 0},
  };
  run_ranks(w, [&](int) {
    auto mesh = init_device_mesh("cpu", {w});
    for (int64_t rows : {4 * w, 4 * w + 1, 4 * w + 3, w - 1}) {
      at::Tensor full = at::randn({rows, w + 1}, at::kDouble);
      mesh.get_group(0).broadcast(full, 0);
      for (const auto& c : cases) {
        SCOPED_TRACE(c.from.str() + "->" + c.to.str() + " rows=" + std::to_string(rows));
        at::Tensor x = makeWith(full, mesh, {c.from});
        CommCounter comm;
        at::Tensor y = redistribute(x, mesh, {c.to});
        EXPECT_EQ(comm.count(c.coll), c.count);
        EXPECT_EQ(comm.total_count(), c.count);
        EXPECT_EQ(placements(y), Placements{c.to});
        EXPECT_CLOSE(full_tensor(y), full, 1e-5, 1e-8);

        // Backward: d/dx sum(full(y) * g) = g, whatever the placements (a
        // Partial source gets the whole gradient, replicated).
        at::Tensor leaf = makeWith(full, mesh, {c.from}).detach().requires_grad_(true);
        at::Tensor g = at::arange(full.numel(), at::kDouble).view(full.sizes());
        at::Tensor loss = (full_tensor(redistribute(leaf, mesh, {c.to})) * g).sum();
        loss.backward();
        ASSERT_TRUE(leaf.grad().defined());
        EXPECT_EQ(placements(leaf.grad()),
                  Placements{c.from.is_partial() ? Replicate() : c.from});
        EXPECT_CLOSE(full_tensor(leaf.grad()), g, 1e-5, 1e-8)
            << "grad placements " << to_string(placements(leaf.grad()));
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, RedistributeTest, ::testing::Values(2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

TEST(RedistributeTest2D, AllPlacementPairsOnTwoByTwo) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    const Placements single = {Shard(0), Shard(1), Replicate(), Partial()};
    at::Tensor full = at::arange(7 * 5, at::kDouble).view({7, 5});
    for (const auto& a : single)
      for (const auto& b : single)
        for (const auto& c : single)
          for (const auto& d : single) {
            SCOPED_TRACE(a.str() + b.str() + "->" + c.str() + d.str());
            at::Tensor x = makeWith(full, mesh, {a, b});
            at::Tensor y = redistribute(x, mesh, {c, d});
            EXPECT_CLOSE(full_tensor(y), full, 1e-5, 1e-8);
          }
  });
}

TEST(DTensorApiTest, DistributeFromSourceRankOnly) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    at::Tensor full = rank == 0 ? at::arange(10.).view({5, 2}) : at::zeros({5, 2});
    CommCounter comm;
    at::Tensor x = distribute_tensor(full, mesh, {Shard(0)});
    EXPECT_EQ(comm.count(CollectiveType::Scatter), 1);
    EXPECT_TRUE(to_local(x).equal(at::arange(10.).view({5, 2}).narrow(0, rank * 3, rank ? 2 : 3)));
    at::Tensor r = distribute_tensor(full, mesh, {Replicate()});
    EXPECT_TRUE(to_local(r).equal(at::arange(10.).view({5, 2})));
    // src_data_rank = nullopt: local data, no communication.
    comm.reset();
    at::Tensor own = distribute_tensor(full, mesh, {Replicate()}, std::nullopt);
    EXPECT_EQ(comm.total_count(), 0);
    EXPECT_TRUE(to_local(own).equal(full));
  });
}

TEST(DTensorApiTest, FromLocalRunCheckRejectsInconsistentShards) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    at::Tensor local = at::ones({rank == 0 ? 3 : 1, 4});
    try {
      from_local(local, mesh, {Shard(0)}, /*run_check=*/true, std::vector<int64_t>{5, 4});
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("from_local"), std::string::npos) << e.what();
    }
    // Consistent uneven shards with an explicit shape pass.
    at::Tensor ok = at::ones({rank == 0 ? 3 : 2, 4});
    EXPECT_EQ(from_local(ok, mesh, {Shard(0)}, true, std::vector<int64_t>{5, 4}).sizes(),
              (c10::IntArrayRef{5, 4}));
  });
}

// Without run_check, shards that fit no one global shape make the ranks post
// buffers of sizes their peers do not expect (NOTE: [Collective checks]).
// With TORCH_DISTRIBUTED_DEBUG=DETAIL that is an error on every rank naming
// each rank's call; without it, on the shared-memory path an error on every
// rank, and on Gloo alone (DTP_SHM=0) Gloo terminates the process and dtp
// says why.
TEST(DTensorApiTest, FromLocalWithoutRunCheckInconsistentShardsAreCaught) {
  auto inconsistent = [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    at::Tensor d = from_local(at::ones({rank == 0 ? 2 : 3, 4}), mesh, {Shard(0)}, /*run_check=*/false);
    return full_tensor(d);  // rank 0 expects [4, 4], rank 1 [6, 4]
  };
  setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL", 1);
  run_ranks(2, [&](int rank) {
    dtp::test::expect_error([&] { inconsistent(rank); },
                            {"disagree on collective #1", "global rank 0: all_gather of Float[2, 4] along dim 0 with sizes [2, 2]",
                             "global rank 1: all_gather of Float[3, 4] along dim 0 with sizes [3, 3]", "run_check=true"});
    // Consistent calls pass the check, which CommCounter does not count.
    auto mesh = init_device_mesh("cpu", {2});
    CommCounter comm;
    at::Tensor ok = full_tensor(from_local(at::full({2, 4}, double(rank)), mesh, {Shard(0)}, false));
    EXPECT_TRUE(ok.equal(at::cat({at::zeros({2, 4}, at::kDouble), at::ones({2, 4}, at::kDouble)})));
    EXPECT_EQ(comm.total_count(), 1);
  });
  unsetenv("TORCH_DISTRIBUTED_DEBUG");
  run_ranks(2, [&](int rank) {
    dtp::test::expect_error([&] { inconsistent(rank); },
                            {"all_gather #1", "the ranks disagree on a collective's shapes",
                             "Rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL"});
  });
  setenv("DTP_SHM", "0", 1);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(run_ranks(2, [&](int rank) { inconsistent(rank); }),
               "the ranks disagree on a collective's shapes .*Rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL");
  unsetenv("DTP_SHM");
}

// Ranks handed different values for a Replicate dim agree after run_check
// (first rank's values, as PyTorch's broadcast); without it they are trusted.
TEST(DTensorApiTest, FromLocalRunCheckMakesReplicasAgree) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    const at::Tensor mine = at::full({2, 3}, static_cast<double>(rank));
    at::Tensor local = mine.clone().requires_grad_(true);
    at::Tensor d = from_local(local, mesh, {Replicate(), Shard(0)}, /*run_check=*/true);
    // Mesh dim 0 is replicated: ranks r and r+2 take rank (r % 2)'s values.
    EXPECT_TRUE(to_local(d).equal(at::full({2, 3}, static_cast<double>(rank % 2)))) << to_local(d);
    EXPECT_TRUE(local.detach().equal(to_local(d)));
    EXPECT_TRUE(full_tensor(d).equal(at::cat({at::full({2, 3}, 0.0), at::full({2, 3}, 1.0)})));
    (d * 2).sum().backward();
    EXPECT_TRUE(local.grad().defined());
    at::Tensor trusted = from_local(mine.clone(), mesh, {Replicate(), Shard(0)});
    EXPECT_TRUE(to_local(trusted).equal(mine));
  });
}

TEST(DTensorApiTest, ToLocalGradPlacementsAndFromLocalBackward) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    at::Tensor local = at::full({2, 3}, rank + 1.0).requires_grad_(true);
    at::Tensor x = from_local(local, mesh, {Shard(0)});
    EXPECT_EQ(x.sizes(), (c10::IntArrayRef{4, 3}));
    EXPECT_TRUE(x.requires_grad());
    at::Tensor y = to_local(x * 3);
    y.sum().backward();
    EXPECT_TRUE(local.grad().equal(at::full({2, 3}, 3.0)));
  });
}

}  // namespace

// As in PyTorch, redistributing to the same placements is a gradient
// boundary: a Partial gradient of a Replicate tensor is all-reduced there.
TEST(DTensorTest, RedistributeToSamePlacementsReducesPartialGradient) {
  run_ranks(2, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    at::Tensor x = distribute_tensor(at::ones({3, 2}).requires_grad_(), mesh, {Replicate()});
    at::Tensor y = redistribute(x, mesh, {Replicate()});
    EXPECT_FALSE(y.is_same(x));
    CommCounter comm;
    (to_local(y, Placements{Partial()}) * (rank + 1)).sum().backward();
    EXPECT_EQ(comm.count(CollectiveType::AllReduce), 1) << comm.str();
    EXPECT_EQ(placements(x.grad()), Placements{Replicate()});
    EXPECT_TRUE(to_local(x.grad()).equal(at::full({3, 2}, 3.0)));
    at::NoGradGuard no_grad;
    EXPECT_TRUE(redistribute(x, mesh, {Replicate()}).is_same(x));
  });
}

// A Partial given up (std::move, a temporary) is all-reduced in its own
// memory; one that anything else still sees (a copy, a detached alias, a
// view, an lvalue argument) is reduced into a new buffer and keeps its value.
// On a one-rank mesh dim every placement holds the whole: redistributing
// there moves and copies nothing, on the other dim as usual.
TEST(DTensorTest, OneRankMeshDimRedistributesWithoutCopies) {
  run_ranks(2, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {1, 2});
    const at::Tensor x = at::arange(12, at::kFloat).view({4, 3}) + rank;
    at::Tensor p = from_local(x, mesh, {Partial(), Replicate()});
    for (const Placements& to : {Placements{Replicate(), Replicate()}, Placements{Shard(1), Replicate()},
                                 Placements{Partial(ReduceOp::Max), Replicate()}}) {
      SCOPED_TRACE(to_string(to));
      CommCounter comm;
      at::Tensor r = redistribute(p, mesh, to);
      EXPECT_EQ(comm.total_count(), 0) << comm.str();
      EXPECT_EQ(to_local(r).data_ptr(), x.data_ptr());
      EXPECT_TRUE(full_tensor(r).equal(x));
    }
    CommCounter comm;
    at::Tensor r = redistribute(p, mesh, {Replicate(), Partial()});
    EXPECT_EQ(comm.total_count(), 0) << comm.str();
    EXPECT_TRUE(to_local(r).equal(rank == 0 ? x : at::zeros_like(x)));  // R -> P(sum) on the 2-rank dim
  });
}

TEST(DTensorTest, GivenUpPartialIsReducedInPlaceOthersAreNot) {
  run_ranks(2, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    auto partial = [&] { return from_local(at::full({3, 2}, rank + 1.0), mesh, {Partial()}); };
    const at::Tensor sum = at::full({3, 2}, 3.0);
    at::Tensor p = partial();
    const void* mem = to_local(p).data_ptr();
    at::Tensor r = redistribute(std::move(p), mesh, {Replicate()});
    EXPECT_EQ(to_local(r).data_ptr(), mem);
    EXPECT_TRUE(to_local(r).equal(sum));
    for (int kind = 0; kind < 4; ++kind) {
      SCOPED_TRACE("kind " + std::to_string(kind));
      at::Tensor q = partial(), keep = kind == 1 ? q.detach() : kind == 2 ? q.view({6}) : q;
      mem = to_local(q).data_ptr();
      r = kind == 3 ? redistribute(q, mesh, {Replicate()}) : redistribute(std::move(q), mesh, {Replicate()});
      EXPECT_NE(to_local(r).data_ptr(), mem);
      EXPECT_TRUE(to_local(r).equal(sum));
      EXPECT_TRUE(to_local(keep).equal(at::full(keep.sizes(), rank + 1.0)));
    }
    // Backward: the engine's gradient buffer is reduced in place unless a
    // hook kept the gradient.
    for (bool kept : {false, true}) {
      at::Tensor x = distribute_tensor(at::ones({3, 2}).requires_grad_(), mesh, {Replicate()});
      at::Tensor y = redistribute(x, mesh, {Replicate()});
      const void* grad_mem = nullptr;
      at::Tensor seen;
      y.register_hook([&](const at::Tensor& g) {
        grad_mem = to_local(g).data_ptr();
        if (kept) seen = g;
      });
      (to_local(y, Placements{Partial()}) * (rank + 1)).sum().backward();
      EXPECT_TRUE(to_local(x.grad()).equal(sum));
      EXPECT_EQ(to_local(x.grad()).data_ptr() == grad_mem, !kept);
      if (kept) EXPECT_TRUE(to_local(seen).equal(at::full({3, 2}, rank + 1.0)));
    }
  });
}

// A DTensor's strides follow its shard's layout over the global shape (NOTE:
// [DTensor strides]), so autograd lays gradients out as for plain tensors:
// a linear weight's gradient (mm through weight.t()) arrives contiguous, and
// a leaf's transposed gradient is copied into its layout by AccumulateGrad
// with its placements kept and nothing communicated.
TEST(DTensorTest, StridesFollowTheShardAndGradientsKeepLayouts) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    const at::Tensor full = at::arange(30, at::kFloat).view({5, 6});
    at::Tensor w = distribute_tensor(full, mesh, {Shard(0)});
    EXPECT_TRUE(w.is_contiguous());
    EXPECT_EQ(w.t().strides(), full.t().strides());
    EXPECT_FALSE(w.t().is_contiguous());
    EXPECT_EQ(w.t().contiguous().strides(), full.t().contiguous().strides());
    EXPECT_TRUE(full_tensor(w.t().contiguous()).equal(full.t()));
    EXPECT_EQ(w.unsqueeze(1).expand({5, 3, 6}).strides(), (std::vector<int64_t>{6, 0, 1}));

    at::Tensor x = distribute_tensor(at::ones({4, 6}), mesh, {Replicate()});
    at::Tensor scale = distribute_tensor(at::arange(5, at::kFloat), mesh, {Replicate()});
    for (bool linear : {true, false}) {
      SCOPED_TRACE(linear ? "linear" : "transposed use");
      at::Tensor leaf = distribute_tensor(full, mesh, {Shard(0)}).requires_grad_();  // no hook
      CommCounter comm;
      at::Tensor y = linear ? at::mm(x, leaf.t()) : leaf.t() * scale;
      to_local(y).sum().backward();
      EXPECT_EQ(dtensor_spec(leaf.grad()).placements, Placements{Shard(0)});
      EXPECT_TRUE(to_local(leaf.grad()).is_contiguous()) << to_local(leaf.grad()).strides();
      const at::Tensor want = linear ? at::full({5, 6}, 4.0) : at::arange(5, at::kFloat).view({5, 1}).expand({5, 6});
      EXPECT_TRUE(full_tensor(leaf.grad()).equal(want));
      EXPECT_EQ(comm.total_count(), 1) << comm.str();  // full_tensor's all-gather
    }
  });
}
