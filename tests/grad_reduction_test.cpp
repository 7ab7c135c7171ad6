// Replicated parameters with Partial gradients are reduced in one bucket per
// dtype at the end of backward (NOTE: [Bucketed gradient reduction]), and
// .grad ends up equal to one device's however AccumulateGrad stores it.
#include "close.h"
#include "dist.h"
#include "parity.h"

#include "dtp/comm_counter.h"
#include "dtp/device_mesh.h"
#include "dtp/fused_ops.h"

#include <torch/csrc/autograd/autograd.h>

using namespace dtp;
using dtp::test::data;
using dtp::test::run_ranks;

namespace {

constexpr int64_t kSeq = 7;  // uneven over 2 and 4 ranks

// Norm-like replicated parameters: two f32 and one f64.
struct Params {
  at::Tensor w, b, v;
  std::vector<at::Tensor> all() const { return {w, b, v}; }
};

Params makeParams(const DeviceMesh* mesh) {
  auto make = [&](at::Tensor t) {
    t.requires_grad_(true);
    return mesh ? distribute_tensor(t, *mesh, {Replicate()}) : t;
  };
  return {make(data({6}, 0.1).to(at::kFloat)), make(data({6}, 0.2).to(at::kFloat)),
          make(data({3}, 0.3))};
}

// The loss on full inputs (reference) or on this rank's sequence shard.
at::Tensor loss(const Params& p, const at::Tensor& x, const at::Tensor& xd) {
  at::Tensor y = (x * p.w + p.b).tanh();
  at::Tensor z = (xd * p.v).sin();
  if (!is_dtensor(y)) return y.sum() + z.sum().to(at::kFloat);
  return to_local(y).sum() + to_local(z).sum().to(at::kFloat);
}

struct Case {
  Params ref, dist;
  at::Tensor x, xd, x_local, xd_local;
  Case(const DeviceMesh& mesh, int w, int rank)
      : ref(makeParams(nullptr)), dist(makeParams(&mesh)) {
    const at::Tensor x_full = data({2, kSeq, 6}, 1.0).to(at::kFloat);
    const at::Tensor xd_full = data({2, kSeq, 3}, 2.0);
    x = x_full;
    xd = xd_full;
    const auto sizes = dtp::test::chunk_sizes(kSeq, w);
    int64_t start = 0;
    for (int r = 0; r < rank; ++r) start += sizes[r];
    x_local = from_local(x_full.narrow(1, start, sizes[rank]), mesh, {Shard(1)}, false,
                         x_full.sizes().vec());
    xd_local = from_local(xd_full.narrow(1, start, sizes[rank]), mesh, {Shard(1)}, false,
                          xd_full.sizes().vec());
    loss(ref, x, xd).backward();
  }
  at::Tensor distLoss() const { return loss(dist, x_local, xd_local); }
  // Every gradient is Replicate and equals `scale` times one device's.
  void expectGrads(const std::vector<at::Tensor>& grads, double scale, const char* what) const {
    const auto want = ref.all();
    for (size_t i = 0; i < grads.size(); ++i) {
      ASSERT_TRUE(grads[i].defined()) << what << ": no gradient for parameter " << i;
      EXPECT_EQ(placements(grads[i]), Placements{Replicate()}) << what;
      EXPECT_CLOSE(to_local(grads[i]), want[i].grad() * scale, 1e-5, 1e-6)
          << what << ": parameter " << i << " got " << to_local(grads[i]) << " want "
          << want[i].grad() * scale;
    }
  }
  std::vector<at::Tensor> grads() const {
    std::vector<at::Tensor> g;
    for (const auto& p : dist.all()) g.push_back(p.grad());
    return g;
  }
};

class GradReductionTest : public ::testing::TestWithParam<int> {};

TEST_P(GradReductionTest, OneAllReducePerDtypeWhateverAccumulateGradDoes) {
  const int w = GetParam();
  run_ranks(w, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {w});
    Case c(mesh, w, rank);
    {
      CommCounter comm;  // .grad undefined: AccumulateGrad adopts or copies
      c.distLoss().backward();
      EXPECT_EQ(comm.count(CollectiveType::AllReduce), 2) << comm.str();
      EXPECT_EQ(comm.total_count(), 2) << comm.str();
      EXPECT_EQ(comm.bytes(CollectiveType::AllReduce), (6 + 6) * 4 + 3 * 8) << comm.str();
      c.expectGrads(c.grads(), 1.0, "first backward");
    }
    for (const auto& p : c.dist.all()) p.mutable_grad().zero_();  // zero_grad as in libtorch 1.13
    {
      CommCounter comm;
      c.distLoss().backward();
      EXPECT_EQ(comm.count(CollectiveType::AllReduce), 2) << comm.str();
      c.expectGrads(c.grads(), 1.0, "after zeroing .grad");
    }
    c.distLoss().backward();  // accumulates onto reduced gradients
    c.expectGrads(c.grads(), 2.0, "accumulated twice");
  });
}

TEST_P(GradReductionTest, AutogradGradReturnsReducedAndLeavesGradAlone) {
  const int w = GetParam();
  run_ranks(w, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {w});
    Case c(mesh, w, rank);
    auto grads = torch::autograd::grad({c.distLoss()}, {c.dist.w, c.dist.v});
    // libtorch 1.13 captures before tensor hooks run: the Partial gradient
    // comes back as is; 2.x runs the hook and returns the reduced one.
    const auto want = c.ref.all();
    EXPECT_CLOSE(full_tensor(grads[0]), want[0].grad(), 1e-5, 1e-6);
    EXPECT_CLOSE(full_tensor(grads[1]), want[2].grad(), 1e-10, 1e-10);
    for (const auto& p : c.dist.all()) EXPECT_FALSE(p.grad().defined());
  });
}

TEST_P(GradReductionTest, CreateGraphReducesEachGradientAsItArrives) {
  const int w = GetParam();
  run_ranks(w, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {w});
    Case c(mesh, w, rank);
    CommCounter comm;
    c.distLoss().backward({}, /*retain_graph=*/true, /*create_graph=*/true);
    EXPECT_EQ(comm.count(CollectiveType::AllReduce), 3) << comm.str();
    c.expectGrads(c.grads(), 1.0, "create_graph");
    for (const auto& p : c.dist.all()) p.mutable_grad() = at::Tensor();  // break the grad cycle
  });
}

// A second derivative through a replicated leaf's reduced gradient equals
// one device's in float64: under create_graph the gradient the hook returns
// keeps its history (libtorch 2.x returns that one from autograd::grad).
TEST_P(GradReductionTest, LeafGradientKeepsItsHistoryUnderCreateGraph) {
  const int w = GetParam();
  run_ranks(w, [&](int) {
    auto mesh = init_device_mesh("cpu", {w});
    const at::Tensor x = data({2, 5, 7}, 0.1), v = data({7, 3}, 0.2);
    const at::Tensor xr = x.clone().requires_grad_(), vr = v.clone().requires_grad_();
    const at::Tensor gr = torch::autograd::grad({at::matmul(xr, vr).pow(2).sum()}, {xr}, {}, true, true)[0];
    gr.pow(2).sum().backward();
    const at::Tensor dx = distribute_tensor(x.clone().requires_grad_(), mesh, {Replicate()});
    const at::Tensor dv = distribute_tensor(v.clone().requires_grad_(), mesh, {Shard(1)});
    DecomposeFusedOpsGuard decompose;  // create_graph through a fused matmul is refused by name
    const at::Tensor g = torch::autograd::grad({at::matmul(dx, dv).pow(2).sum()}, {dx}, {}, true, true)[0];
    EXPECT_CLOSE(full_tensor(g), gr, 1e-12, 1e-12);
    g.pow(2).sum().backward();
    EXPECT_CLOSE(full_tensor(dv.grad()), vr.grad(), 0.0, 1e-12);
  });
}

TEST_P(GradReductionTest, BackwardThatThrowsLeavesNothingPending) {
  const int w = GetParam();
  run_ranks(w, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {w});
    Case c(mesh, w, rank);
    // Fail at one parameter's hook, then at another's: in one of the two
    // backwards another parameter's partial is already pending.
    int failing = -1;
    const auto params = c.dist.all();
    for (int i : {0, 2}) {
      params[i].register_hook([&failing, i](const at::Tensor& g) {
        TORCH_CHECK(failing != i, "injected failure");
        return g;
      });
    }
    for (int i : {0, 2}) {
      failing = i;
      dtp::test::expect_error([&] { c.distLoss().backward(); }, {"injected failure"});
    }
    failing = -1;
    for (const auto& p : c.dist.all()) p.mutable_grad() = at::Tensor();
    CommCounter comm;
    c.distLoss().backward();
    EXPECT_EQ(comm.count(CollectiveType::AllReduce), 2) << comm.str();
    c.expectGrads(c.grads(), 1.0, "after a failed backward");
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, GradReductionTest, ::testing::Values(2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

}  // namespace
