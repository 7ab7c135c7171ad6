// The per-thread dispatch context (NOTE: [Dispatch context]): the public
// guards are scopes of its switches, they nest and restore in any order of
// destruction, and each thread (each rank, when ranks are threads) has its
// own.
#include "close.h"
#include "dist.h"

#include "dtensor/dispatch_context.h"
#include "dtensor/fused_ops.h"
#include "dtensor/sharding_prop.h"
#include "dtp/dtensor.h"
#include "dtp/explicit_redistribute.h"
#include "dtp/fused_ops.h"

#include <torch/csrc/autograd/function.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

using namespace dtp;
using dtp::detail::dispatch_context;
using dtp::test::run_ranks;

namespace {

// What the context's switches say, as the public guards report them.
void expectGuardsReportTheContext() {
  const auto& ctx = dispatch_context();
  EXPECT_EQ(ImplicitReplicationGuard::enabled(), ctx.implicit_replication.get(false));
  EXPECT_EQ(ReplicateFallbackGuard::enabled(), ctx.replicate_fallback.get(false));
  EXPECT_EQ(DecomposeFusedOpsGuard::enabled(), ctx.decompose_fused.get(false));
  if (ctx.explicit_redistribute.depth() > 0)
    EXPECT_EQ(ExplicitRedistributeGuard::mode(), ctx.explicit_redistribute.get(ExplicitRedistributeMode::Off));
}

TEST(DispatchContext, GuardsNestAndRestore) {
  EXPECT_FALSE(ImplicitReplicationGuard::enabled());
  EXPECT_FALSE(ReplicateFallbackGuard::enabled());
  EXPECT_FALSE(DecomposeFusedOpsGuard::enabled());
  const ExplicitRedistributeMode outside = ExplicitRedistributeGuard::mode();
  {
    ImplicitReplicationGuard a;
    EXPECT_TRUE(ImplicitReplicationGuard::enabled());
    {
      ImplicitReplicationGuard b;
      ReplicateFallbackGuard c;
      DecomposeFusedOpsGuard d;
      EXPECT_TRUE(ImplicitReplicationGuard::enabled());
      EXPECT_TRUE(ReplicateFallbackGuard::enabled());
      EXPECT_TRUE(DecomposeFusedOpsGuard::enabled());
      EXPECT_EQ(dispatch_context().implicit_replication.depth(), 2u);
      expectGuardsReportTheContext();
    }
    EXPECT_TRUE(ImplicitReplicationGuard::enabled()) << "the outer guard still holds";
    EXPECT_FALSE(ReplicateFallbackGuard::enabled());
    EXPECT_FALSE(DecomposeFusedOpsGuard::enabled());
    ExplicitRedistributeGuard warn(ExplicitRedistributeMode::Warn);
    EXPECT_EQ(ExplicitRedistributeGuard::mode(), ExplicitRedistributeMode::Warn);
    {
      ExplicitRedistributeGuard off(ExplicitRedistributeMode::Off);
      EXPECT_EQ(ExplicitRedistributeGuard::mode(), ExplicitRedistributeMode::Off);
      expectGuardsReportTheContext();
    }
    EXPECT_EQ(ExplicitRedistributeGuard::mode(), ExplicitRedistributeMode::Warn);
  }
  EXPECT_FALSE(ImplicitReplicationGuard::enabled());
  EXPECT_EQ(ExplicitRedistributeGuard::mode(), outside);
  EXPECT_EQ(dispatch_context().implicit_replication.depth(), 0u);
  EXPECT_EQ(dispatch_context().explicit_redistribute.depth(), 0u);
  expectGuardsReportTheContext();
}

TEST(DispatchContext, GuardsDestroyedOutOfOrderLeaveNothingBehind) {
  const ExplicitRedistributeMode outside = ExplicitRedistributeGuard::mode();
  auto outer = std::make_unique<ExplicitRedistributeGuard>(ExplicitRedistributeMode::Warn);
  auto inner = std::make_unique<ExplicitRedistributeGuard>(ExplicitRedistributeMode::Error);
  EXPECT_EQ(ExplicitRedistributeGuard::mode(), ExplicitRedistributeMode::Error);
  outer.reset();  // the outer one leaves first: the inner one still decides
  EXPECT_EQ(ExplicitRedistributeGuard::mode(), ExplicitRedistributeMode::Error);
  inner.reset();
  EXPECT_EQ(ExplicitRedistributeGuard::mode(), outside);

  auto a = std::make_unique<ImplicitReplicationGuard>();
  auto b = std::make_unique<DecomposeFusedOpsGuard>();
  auto c = std::make_unique<ImplicitReplicationGuard>();
  a.reset();
  EXPECT_TRUE(ImplicitReplicationGuard::enabled()) << "c is still live";
  b.reset();
  EXPECT_FALSE(DecomposeFusedOpsGuard::enabled());
  c.reset();
  EXPECT_FALSE(ImplicitReplicationGuard::enabled()) << "a restored by value would have left true behind";
  expectGuardsReportTheContext();
}

TEST(DispatchContext, ThreadsHaveIndependentContexts) {
  std::mutex mutex;
  std::condition_variable cv;
  int stage = 0;  // 1: the first thread's guards are open; 2: the second thread has looked
  auto waitFor = [&](int s) {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return stage >= s; });
  };
  auto advance = [&](int s) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stage = s;
    }
    cv.notify_all();
  };
  const ExplicitRedistributeMode outside = ExplicitRedistributeGuard::mode();
  std::thread first([&] {
    ImplicitReplicationGuard implicit;
    ReplicateFallbackGuard fallback;
    DecomposeFusedOpsGuard decompose;
    ExplicitRedistributeGuard strict(ExplicitRedistributeMode::Error);
    advance(1);
    waitFor(2);
    EXPECT_TRUE(ImplicitReplicationGuard::enabled());
    EXPECT_EQ(ExplicitRedistributeGuard::mode(), ExplicitRedistributeMode::Error);
  });
  std::thread second([&] {
    waitFor(1);
    EXPECT_FALSE(ImplicitReplicationGuard::enabled()) << "another thread's guard";
    EXPECT_FALSE(ReplicateFallbackGuard::enabled());
    EXPECT_FALSE(DecomposeFusedOpsGuard::enabled());
    EXPECT_EQ(ExplicitRedistributeGuard::mode(), outside);
    EXPECT_EQ(dispatch_context().explicit_redistribute.depth(), 0u);
    advance(2);
  });
  first.join();
  second.join();

  // The caches too: each rank's thread counts its own decisions.
  std::vector<int64_t> asked(2);
  run_ranks(2, [&](int rank) {
    const auto mesh = init_device_mesh("cpu", {2});
    const at::Tensor a = distribute_tensor(at::ones({4, 6}), mesh, {Shard(0)});
    const auto before = propagation_cache_stats();
    for (int i = 0; i <= rank * 2; ++i) (void)(a * 2.0);
    const auto after = propagation_cache_stats();
    asked[rank] = (after.hits + after.misses) - (before.hits + before.misses);
  });
  EXPECT_EQ(asked[0], 1) << "rank 0 ran one op";
  EXPECT_EQ(asked[1], 3) << "rank 1 ran three";
}

// NOTE: [Which products fuse]: the one shape rule that the fallback's
// "fused products" step and the autograd kernels' fused graph both ask.
TEST(DispatchContext, OneRuleSaysWhichProductsFuse) {
  using dtp::detail::FusedProduct;
  using dtp::detail::fuses_as_product;
  EXPECT_TRUE(fuses_as_product(FusedProduct::Linear, 1, 2));
  EXPECT_TRUE(fuses_as_product(FusedProduct::Linear, 3, 2));
  EXPECT_FALSE(fuses_as_product(FusedProduct::Linear, 2, 1));
  EXPECT_FALSE(fuses_as_product(FusedProduct::Matmul, 1, 2)) << "a vector by a matrix is ATen's unsqueezed mm";
  EXPECT_TRUE(fuses_as_product(FusedProduct::Matmul, 2, 2));
  EXPECT_TRUE(fuses_as_product(FusedProduct::Matmul, 3, 2));
  EXPECT_FALSE(fuses_as_product(FusedProduct::Matmul, 3, 3));
  EXPECT_FALSE(fuses_as_product(FusedProduct::None, 2, 2));
}

// Under autograd, a bias-free linear of a 1-D input takes the fused graph
// (the rule's x at least 1-D), with one device's values and gradients.
TEST(DispatchContext, LinearOfAVectorFusesUnderAutograd) {
  const at::Tensor x = at::arange(8, at::kDouble) * 0.1 - 0.3;
  const at::Tensor w = at::arange(24, at::kDouble).reshape({3, 8}) * 0.05 - 0.4;
  at::Tensor xr = x.clone().requires_grad_(), wr = w.clone().requires_grad_();
  const at::Tensor ref = at::linear(xr, wr);
  ref.sum().backward();
  const std::vector<std::pair<Placement, Placement>> cases = {
      {Replicate(), Shard(0)}, {Shard(0), Shard(1)}, {Replicate(), Replicate()}};
  run_ranks(2, [&](int) {
    const auto mesh = init_device_mesh("cpu", {2});
    for (const auto& [px, pw] : cases) {
      const at::Tensor fx = distribute_tensor(x.clone().requires_grad_(), mesh, {px});
      const at::Tensor fw = distribute_tensor(w.clone().requires_grad_(), mesh, {pw});
      const at::Tensor fy = at::linear(fx, fw);
      EXPECT_EQ(fy.grad_fn()->name(), "dtp::FusedOutBackward") << px.str() << " " << pw.str();
      EXPECT_CLOSE(full_tensor(fy), ref, 0.0, 1e-12);
      full_tensor(fy).sum().backward();
      EXPECT_CLOSE(full_tensor(fx.grad()), xr.grad(), 0.0, 1e-12);
      EXPECT_CLOSE(full_tensor(fw.grad()), wr.grad(), 0.0, 1e-12);
    }
  });
}

}  // namespace
