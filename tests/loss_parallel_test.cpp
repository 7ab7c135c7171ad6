// loss_parallel: cross-entropy on class-sharded logits, ported from PyTorch's
// test_math_ops.py::test_loss_parallel (3 all-reduces forward, none backward,
// values equal to one device) plus what PyTorch leaves out: uneven and empty
// class shards, batch sharding, 2-D meshes, ignore_index, label smoothing.
#include "close.h"
#include "dist.h"
#include "parity.h"

#include "dtensor/rule_registry.h"
#include "dtp/comm_counter.h"
#include "dtp/tp/loss_parallel.h"

#include <torch/csrc/autograd/function.h>
#include <torch/nn/functional/loss.h>

#include <optional>

using namespace dtp;
using dtp::test::data;
using dtp::test::run_ranks;
namespace F = torch::nn::functional;

namespace {

F::CrossEntropyFuncOptions::reduction_t reductionOf(int i) {
  if (i == 0) return torch::kNone;
  if (i == 1) return torch::kMean;
  return torch::kSum;
}

at::Tensor targets(std::vector<int64_t> shape, int64_t classes, bool with_ignored = false) {
  at::Tensor t = at::remainder(at::arange(c10::multiply_integers(shape), at::kLong) * 7 + 3, classes).view(shape);
  if (with_ignored) t.view(-1).index_put_({at::arange(0, t.numel(), 3)}, -100);
  return t;
}

// Cross-entropy of `logits` sharded by `pls` against one device: value,
// gradient and collectives forward and backward, both through cross_entropy
// under the guard and through loss_parallel_cross_entropy (fused on 2-D
// logits without label smoothing).
void checkCrossEntropy(const DeviceMesh& mesh, const at::Tensor& x, const at::Tensor& target,
                       const Placements& pls, const F::CrossEntropyFuncOptions& opts,
                       int64_t fwd_all_reduces, int64_t bwd_total, bool dtensor_target = false) {
  at::Tensor ref_x = x.detach().clone().requires_grad_(true);
  at::Tensor y = F::cross_entropy(ref_x, target, opts);
  (opts.reduction().index() == 0 ? y.sum() : y).backward();
  at::Tensor t = target;
  if (dtensor_target) {
    Placements tp;
    for (const auto& p : pls) tp.push_back(p.is_shard() && p.dim == 0 ? Shard(0) : Replicate());
    t = distribute_tensor(target, mesh, tp);
  }
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "loss_parallel_cross_entropy" : "cross_entropy under LossParallelGuard");
    at::Tensor dx = distribute_tensor(x.detach().clone().requires_grad_(true), mesh, pls);
    LossParallelGuard guard;
    CommCounter fwd;
    at::Tensor dy = fused ? loss_parallel_cross_entropy(dx, t, opts) : F::cross_entropy(dx, t, opts);
    if (fwd_all_reduces >= 0) {
      EXPECT_EQ(fwd.count(CollectiveType::AllReduce), fwd_all_reduces) << fwd.str();
      EXPECT_EQ(fwd.total_count(), fwd_all_reduces) << fwd.str();
    }
    if (fused) {
      const bool fusable = x.dim() == 2 && opts.label_smoothing() == 0.0 && pls.back().is_shard() &&
                           pls.back().dim == 1;
      EXPECT_EQ(dy.grad_fn()->name() == "dtp::CrossEntropyBackward", fusable) << dy.grad_fn()->name();
    }
    ASSERT_TRUE(is_dtensor(dy));
    at::Tensor full_y = full_tensor(dy);
    ASSERT_EQ(full_y.sizes(), y.sizes());
    EXPECT_CLOSE(full_y, y, 1e-6, 1e-6) << full_y << y;
    CommCounter bwd;
    (opts.reduction().index() == 0 ? dy.sum() : dy).backward();
    if (bwd_total >= 0) EXPECT_EQ(bwd.total_count(), bwd_total) << bwd.str();
    ASSERT_TRUE(dx.grad().defined());
    EXPECT_EQ(placements(dx.grad()), pls);
    EXPECT_CLOSE(full_tensor(dx.grad()), ref_x.grad(), 1e-6, 1e-6);
  }
}

class LossParallelTest : public ::testing::TestWithParam<int> {};

// PyTorch's test: [8, C] (nll_loss) and [8, C, 12] (nll_loss2d), weight,
// every reduction; here also with an uneven class count and an empty shard.
TEST_P(LossParallelTest, ClassShardedMatchesOneDeviceWithThreeAllReducesForward) {
  const int w = GetParam();
  run_ranks(w, [&](int) {
    auto mesh = init_device_mesh("cpu", {w});
    for (int64_t classes : {16, 2 * w + 1, w - 1 > 1 ? w - 1 : 3}) {
      at::Tensor weight = data({classes}, 2.0).abs().to(at::kFloat) + 0.1;
      for (bool three_d : {false, true}) {
        std::vector<int64_t> shape = three_d ? std::vector<int64_t>{8, classes, 12}
                                             : std::vector<int64_t>{8, classes};
        std::vector<int64_t> tshape = three_d ? std::vector<int64_t>{8, 12} : std::vector<int64_t>{8};
        at::Tensor x = data(shape).to(at::kFloat) * 3;
        for (int red = 0; red < 3; ++red) {
          SCOPED_TRACE("classes " + std::to_string(classes) + (three_d ? " 3-D" : " 2-D") + " reduction " +
                       std::to_string(red));
          checkCrossEntropy(mesh, x, targets(tshape, classes), {Shard(1)},
                            F::CrossEntropyFuncOptions().weight(weight).reduction(reductionOf(red)), 3, 0);
        }
      }
    }
  });
}

TEST_P(LossParallelTest, IgnoreIndexDTensorTargetAndOneSample) {
  const int w = GetParam();
  run_ranks(w, [&](int) {
    auto mesh = init_device_mesh("cpu", {w});
    at::Tensor x = data({20, 11}).to(at::kFloat);  // 20 rows: log_softmax sums 7 blocks of rows
    for (int red = 0; red < 3; ++red) {
      checkCrossEntropy(mesh, x, targets({20}, 11, /*with_ignored=*/true), {Shard(1)},
                        F::CrossEntropyFuncOptions().reduction(reductionOf(red)), 3, 0, /*dtensor_target=*/true);
    }
    // One sample: logits [C], target 0-dim.
    checkCrossEntropy(mesh, data({11}).to(at::kFloat), at::scalar_tensor(4, at::kLong), {Shard(0)},
                      F::CrossEntropyFuncOptions(), 3, 0);
  });
}

// Label smoothing goes through the general path: exact for none and sum;
// a mean needs masked_select on the smoothing term, which is a clear error.
TEST_P(LossParallelTest, LabelSmoothingIsExactInEveryReduction) {
  const int w = GetParam();
  run_ranks(w, [&](int) {
    auto mesh = init_device_mesh("cpu", {w});
    at::Tensor x = data({5, 9}).to(at::kFloat) * 2;
    at::Tensor weight = data({9}, 1.0).abs().to(at::kFloat);
    for (int red : {0, 1, 2}) {
      SCOPED_TRACE("reduction " + std::to_string(red));
      auto opts = F::CrossEntropyFuncOptions().label_smoothing(0.1).reduction(reductionOf(red));
      checkCrossEntropy(mesh, x, targets({5}, 9), {Shard(1)}, opts, -1, -1);
      // Ignored rows (zeroed in the smoothing term) and class weights.
      checkCrossEntropy(mesh, x, targets({5}, 9, /*with_ignored=*/true), {Shard(1)}, opts, -1, -1);
      checkCrossEntropy(mesh, x, targets({5}, 9, true), {Shard(1)}, opts.weight(weight), -1, -1,
                        /*dtensor_target=*/true);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, LossParallelTest, ::testing::Values(2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

// PyTorch raises for non-class sharding under loss_parallel; dtp computes it
// (batch rows are independent) and supports dp x tp meshes.
TEST(LossParallelMeshTest, BatchShardingAndTwoDimensionalMesh) {
  run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    at::Tensor x = data({6, 10}).to(at::kFloat);
    at::Tensor weight = data({10}, 1.0).abs().to(at::kFloat);
    for (int red = 0; red < 3; ++red) {
      auto opts = F::CrossEntropyFuncOptions().weight(weight).reduction(reductionOf(red));
      // 3 all-reduces on tp; a mean also sums the total weight over dp.
      checkCrossEntropy(mesh, x, targets({6}, 10), {Shard(0), Shard(1)}, opts, red == 1 ? 4 : 3, -1,
                        /*dtensor_target=*/true);
      checkCrossEntropy(mesh, x, targets({6}, 10), {Replicate(), Shard(1)}, opts, 3, 0);
    }
    // Sharded on the batch dim only: PyTorch's loss_parallel raises, so does
    // dtp's (#54); a (dp, tp) mesh with the class dim on tp is the way.
    auto m1 = init_device_mesh("cpu", {4});
    dtp::test::expect_error([&] { checkCrossEntropy(m1, x, targets({6}, 10), {Shard(0)}, F::CrossEntropyFuncOptions(), -1, -1); },
                            {"loss_parallel: expected logits sharded on the class dim 1, got f32[6,10](S(0))"});
  });
}

// Backward runs outside the guard, also for logits that are not class-sharded
// (a TP degree of 1, replicated logits), whose backward sees the plain target.
TEST(LossParallelMeshTest, DirectFunctionNeedsNoGuard) {
  for (int w : {1, 2}) {
    run_ranks(w, [&](int) {
      auto mesh = init_device_mesh("cpu", {w});
      at::Tensor x = data({4, 6}).to(at::kFloat);
      at::Tensor t = targets({4}, 6);
      at::Tensor weight = data({6}, 1.0).abs().to(at::kFloat);
      at::Tensor rx = x.detach().clone().requires_grad_(true);
      F::cross_entropy(rx, t, F::CrossEntropyFuncOptions().weight(weight)).backward();
      for (const Placement& p : {Placement(Shard(1)), Placement(Replicate())}) {
        SCOPED_TRACE(to_string(Placements{p}) + " on " + std::to_string(w) + " ranks");
        at::Tensor dx = distribute_tensor(x.detach().clone().requires_grad_(true), mesh, {p});
        EXPECT_FALSE(LossParallelGuard::enabled());
        CommCounter comm;
        at::Tensor loss = loss_parallel_cross_entropy(dx, t, F::CrossEntropyFuncOptions().weight(weight));
        loss.backward();
        EXPECT_EQ(comm.total_count(), p.is_shard() && w > 1 ? 3 : 0) << comm.str();
        EXPECT_FALSE(LossParallelGuard::enabled());
        EXPECT_CLOSE(full_tensor(loss), F::cross_entropy(x, t, F::CrossEntropyFuncOptions().weight(weight)), 1e-6, 1e-6);
        EXPECT_CLOSE(full_tensor(dx.grad()), rx.grad(), 1e-6, 1e-6);
      }
    });
  }
}

// NOTE: [loss_parallel's handlers]: the technique registers its handlers
// beside the ops' ordinary rules. Outside a guard the ordinary rule takes
// class-sharded logits (the class dim made whole: one all_to_all, S(0) out);
// inside, the handler keeps them sharded (max and sum all_reduces, S(1) out).
// Both equal one device in float64.
TEST(LossParallelMeshTest, HandlersAreTheTechniquesAndDeclineOutsideTheGuard) {
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    const at::Tensor x = data({4, 7});  // 7 classes: shards of 4 and 3
    const at::Tensor ref = at::log_softmax(x, 1);
    const at::Tensor dx = distribute_tensor(x, mesh, {Shard(1)});
    for (bool guarded : {false, true, false}) {
      SCOPED_TRACE(guarded ? "inside LossParallelGuard" : "outside any guard");
      std::optional<LossParallelGuard> guard;
      if (guarded) guard.emplace();
      CommCounter comm;
      const at::Tensor y = at::log_softmax(dx, 1);
      EXPECT_EQ(to_string(placements(y)), guarded ? "S(1)" : "S(0)");
      EXPECT_EQ(comm.count(guarded ? CollectiveType::AllReduce : CollectiveType::AllToAll), guarded ? 2 : 1)
          << comm.str();
      EXPECT_EQ(comm.total_count(), guarded ? 2 : 1) << comm.str();
      EXPECT_LE((full_tensor(y) - ref).abs().max().item<double>(), 1e-14);
    }
    const auto& registry = RuleRegistry::get();
    for (const char* op : {"_log_softmax", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward"}) {
      const c10::OperatorName name{std::string("aten::") + op, ""};
      EXPECT_NE(registry.find_handler(name), nullptr) << op;
      EXPECT_NE(registry.find(name), nullptr) << op << ": the ordinary rule must stay beside the handler";
    }
  });
}

TEST(LossParallelMeshTest, BackwardOutsideTheGuardNamesTheFix) {
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    at::Tensor dx = distribute_tensor(data({4, 6}).to(at::kFloat).requires_grad_(true), mesh, {Replicate()});
    at::Tensor loss;
    {
      LossParallelGuard guard;
      loss = F::cross_entropy(dx, targets({4}, 6));
    }
    dtp::test::expect_error([&] { loss.backward(); },
                            {"aten::nll_loss_backward", "'target'", "run backward inside the guard"});
  });
}

// A label outside [0, C) (and not ignore_index) is an error on every rank,
// even on a rank whose classes it would not touch.
TEST(LossParallelMeshTest, TargetOutOfRangeIsAClearError) {
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    at::Tensor dx = distribute_tensor(data({4, 6}).to(at::kFloat), mesh, {Shard(1)});
    for (int64_t bad : {6, -3}) {
      at::Tensor t = targets({4}, 6);
      t[2] = bad;
      dtp::test::expect_error([&] { loss_parallel_cross_entropy(dx, t); },
                              {"target out of range [0, 6)", "fix the labels"});
    }
  });
}

// The fused backward overwrites its saved softmax only when the graph is
// released: retained graphs give the same gradient again, and a backward
// through a released graph is a clear error.
TEST(LossParallelMeshTest, FusedBackwardWithRetainedGraph) {
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    at::Tensor x = data({6, 7}).to(at::kFloat);
    at::Tensor rx = x.detach().clone().requires_grad_(true);
    F::cross_entropy(rx, targets({6}, 7)).backward();
    at::Tensor dx = distribute_tensor(x.detach().clone().requires_grad_(true), mesh, {Shard(1)});
    at::Tensor loss = loss_parallel_cross_entropy(dx, targets({6}, 7));
    ASSERT_EQ(loss.grad_fn()->name(), "dtp::CrossEntropyBackward");
    loss.backward({}, /*retain_graph=*/true);
    loss.backward({}, /*retain_graph=*/true);
    loss.backward();
    EXPECT_CLOSE(full_tensor(dx.grad()), rx.grad() * 3, 1e-6, 1e-6);
    dtp::test::expect_error([&] { loss.backward(); }, {"retain_graph=true"});
  });
}

}  // namespace
