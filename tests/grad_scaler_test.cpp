// GradScaler: loss scaling against an unscaled backward (exact: powers of
// two), the skip decided over every rank, the scale's schedule, float16
// gradients that only survive scaled, the errors.
#include "comm/compat.h"
#include "dist.h"
#include "llama_util.h"

#include "dtp/amp/grad_scaler.h"
#include "dtp/amp/mixed_precision.h"
#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/optim/adamw.h"

#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <cmath>

using namespace dtp;
using namespace dtp::models;
using dtp::test::expect_error;
using dtp::test::kSeq;
using dtp::test::run_ranks;

namespace {

at::Tensor lossOf(Llama& model, int64_t step = 0, double weight = 1.0) {
  const at::Tensor b = dtp::test::llama_batch(model->config.vocab_size, step);
  return llama_loss(model(b.narrow(1, 0, kSeq)), b.narrow(1, 1, kSeq)) * weight;
}

LlamaConfig f64Config() {
  LlamaConfig c = dtp::test::small_llama_config(2);
  c.dtype = at::kDouble;
  return c;
}

// scale(loss).backward() then unscale_ gives loss.backward()'s gradients bit
// for bit (the scale is a power of two), under TP = 2 with DTensor
// gradients, with one all_reduce of the flag over the world per unscale_.
TEST(GradScaler, UnscaledGradientsEqualAnUnscaledBackward) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"tp"});
    Llama model(f64Config());
    parallelize_llama(model, mesh, ParallelizeOptions{});
    dtp::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
    lossOf(model).backward();
    const std::vector<at::Tensor> want = dtp::test::full_grads(model);
    opt.zero_grad();
    GradScaler scaler;  // the world: the default group
    EXPECT_EQ(scaler.get_scale(), 65536.0);
    scaler.scale(lossOf(model)).backward();
    CommCounter comm;
    scaler.unscale_(opt);
    EXPECT_EQ(comm.count(CollectiveType::AllReduce), 1) << comm.str();
    EXPECT_EQ(comm.total_count(), 1) << comm.str();
    const std::vector<at::Tensor> got = dtp::test::full_grads(model);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(at::equal(got[i], want[i])) << "gradient " << i;
    EXPECT_TRUE(scaler.step(opt));
    scaler.update();
    EXPECT_EQ(scaler.growth_tracker(), 1);
  });
}

// An inf in one rank's shard only: every rank skips the step (the
// parameters stay as they were on both) and halves the scale; the next
// clean step steps on both.
TEST(GradScaler, AnInfOnOneRankSkipsTheStepOnEveryRank) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2}, {"tp"});
    Llama model(f64Config());
    parallelize_llama(model, mesh, ParallelizeOptions{});
    dtp::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
    GradScaler scaler(GradScalerOptions().init_scale(1024));
    const auto before = dtp::test::full_named_params(model);
    scaler.scale(lossOf(model)).backward();
    const at::Tensor& w = model->layers[0]->as<TransformerBlockImpl>()->attention->wq->weight;  // ColwiseParallel: S(0)
    ASSERT_TRUE(is_dtensor(w.grad()));
    if (rank == 1) to_local(w.grad())[0][0] = INFINITY;
    EXPECT_FALSE(scaler.step(opt));
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 512.0);
    EXPECT_EQ(scaler.growth_tracker(), 0);
    const auto after = dtp::test::full_named_params(model);
    for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(at::equal(after[i].second, before[i].second)) << after[i].first;
    opt.zero_grad();
    scaler.scale(lossOf(model)).backward();
    EXPECT_TRUE(scaler.step(opt));
    scaler.update();
    EXPECT_FALSE(at::equal(dtp::test::full_named_params(model)[0].second, before[0].second)) << "the clean step stepped";
  });
}

// The schedule: growth after growth_interval clean steps in a row, a
// flagged step backs off and restarts the count, a scale that would grow
// to inf stays; update(new_scale); state_dict round trip.
TEST(GradScaler, ScaleGrowsAfterCleanStepsAndBacksOff) {
  run_ranks(1, [](int) {
    at::Tensor p = at::ones({2}, at::kDouble).requires_grad_(true);
    torch::optim::SGD opt({p}, torch::optim::SGDOptions(0.1));
    GradScaler scaler(GradScalerOptions().init_scale(8).growth_interval(3));
    auto stepWith = [&](double g) {
      opt.zero_grad();
      scaler.scale((p * g).sum()).backward();
      const bool stepped = scaler.step(opt);
      scaler.update();
      return stepped;
    };
    EXPECT_TRUE(stepWith(1));
    EXPECT_TRUE(stepWith(1));
    EXPECT_EQ(scaler.get_scale(), 8.0);
    EXPECT_TRUE(stepWith(1));
    EXPECT_EQ(scaler.get_scale(), 16.0) << "three clean steps in a row";
    EXPECT_EQ(scaler.growth_tracker(), 0);
    EXPECT_TRUE(stepWith(1));
    EXPECT_FALSE(stepWith(NAN));
    EXPECT_EQ(scaler.get_scale(), 8.0);
    EXPECT_EQ(scaler.growth_tracker(), 0) << "a flagged step restarts the count";
    EXPECT_TRUE(at::allclose(p.detach(), at::full({2}, 1 - 4 * 0.1, at::kDouble)));  // 4 steps of -0.1 * 1
    const auto saved = scaler.state_dict();
    scaler.update(3.0);
    EXPECT_EQ(scaler.get_scale(), 3.0);
    GradScaler loaded;
    loaded.load_state_dict(saved);
    EXPECT_EQ(loaded.get_scale(), 8.0);
    EXPECT_EQ(loaded.options().growth_interval(), 3);
    GradScaler big(GradScalerOptions().init_scale(1e308).growth_interval(1));
    opt.zero_grad();
    big.scale((p * 1e-300).sum()).backward();
    EXPECT_TRUE(big.step(opt));
    big.update();
    EXPECT_EQ(big.get_scale(), 1e308) << "a scale that would grow to inf stays";
    GradScaler off(GradScalerOptions().enabled(false));
    const at::Tensor l = (p * 2).sum();
    EXPECT_TRUE(at::equal(off.scale(l), l));
    EXPECT_EQ(off.get_scale(), 1.0);
  });
}

// A loss weighted by 2^-24 (a small loss term): in float16 compute its
// gradients underflow to zero, and through a scaler of 2^24 they are the
// unweighted loss's float16 gradients times 2^-24, bit for bit (the same
// float16 arithmetic; each product by a power of two is exact in float32).
TEST(GradScaler, Float16GradientsSurviveOnlyWithLossScaling) {
#if !DTP_HAS_CPU_HALF_MATMUL
  GTEST_SKIP() << "libtorch 1.13 has no float16 matrix product on CPU (DTP_HAS_CPU_HALF_MATMUL); runs on libtorch 2.x";
#endif
  run_ranks(1, [](int) {
    LlamaConfig c = dtp::test::small_llama_config(2);
    const MixedPrecisionPolicy f16{at::kHalf, at::kFloat};
    const double tiny = std::ldexp(1.0, -24);
    auto grads = [&](double weight, std::optional<double> scale) {
      Llama model(c);
      apply_mixed_precision(*model, f16);
      torch::optim::SGD opt(model->unique_parameters(), torch::optim::SGDOptions(0.1));
      if (!scale) {
        lossOf(model, 0, weight).backward();
      } else {
        GradScaler scaler(GradScalerOptions().init_scale(*scale));
        scaler.scale(lossOf(model, 0, weight)).backward();
        scaler.unscale_(opt);
      }
      return dtp::test::full_grads(model);
    };
    const std::vector<at::Tensor> plain = grads(1.0, std::nullopt);
    const std::vector<at::Tensor> lost = grads(tiny, std::nullopt);
    const std::vector<at::Tensor> kept = grads(tiny, std::ldexp(1.0, 24));
    int64_t nonzero = 0, survived = 0;
    for (size_t i = 0; i < plain.size(); ++i) {
      EXPECT_EQ(kept[i].scalar_type(), at::kFloat) << "the masters' gradients";
      EXPECT_TRUE(at::equal(kept[i], plain[i] * tiny)) << "gradient " << i;
      nonzero += plain[i].ne(0).sum().item<int64_t>();
      survived += lost[i].ne(0).sum().item<int64_t>();
    }
    EXPECT_GT(nonzero, 0);
    EXPECT_LT(survived, nonzero / 10) << "without scaling, float16 loses most gradients of a loss weighted 2^-24";
  });
}

TEST(GradScaler, Errors) {
  run_ranks(1, [](int) {
    at::Tensor p = at::ones({2}).requires_grad_(true);
    torch::optim::SGD opt({p}, torch::optim::SGDOptions(0.1));
    GradScaler scaler;
    expect_error([&] { scaler.update(); }, {"no inf/NaN check was recorded", "step(optimizer)"});
    scaler.scale(p.sum()).backward();
    scaler.unscale_(opt);
    expect_error([&] { scaler.unscale_(opt); }, {"already called on this optimizer", "at most once per step"});
    scaler.step(opt);
    expect_error([&] { scaler.step(opt); }, {"already called on this optimizer", "update()"});
    expect_error([&] { scaler.unscale_(opt); }, {"already called", "once per step"});
    scaler.update();
    at::Tensor h = at::ones({2}, at::kHalf).requires_grad_(true);
    h.mutable_grad() = at::ones({2}, at::kHalf);
    torch::optim::SGD half({h}, torch::optim::SGDOptions(0.1));
    expect_error([&] { scaler.unscale_(half); }, {"parameter 0 of param group 0 has float16 gradients",
                                                  "MixedPrecisionPolicy{at::kHalf, at::kFloat}"});
    expect_error([] { GradScaler(GradScalerOptions().growth_factor(1)); }, {"growth_factor must be > 1", "default is 2"});
    expect_error([] { GradScaler(GradScalerOptions().backoff_factor(1)); }, "backoff_factor must be in (0, 1)");
    expect_error([] { GradScaler(GradScalerOptions().init_scale(0)); }, "init_scale must be positive");
    expect_error([] { GradScaler(GradScalerOptions().growth_interval(0)); }, "growth_interval must be >= 1");
    expect_error([&] { scaler.scale(at::ones({1}, at::kLong)); }, "expected a floating-point loss");
    expect_error([&] { scaler.load_state_dict({}); }, {"the state is empty", "disabled scaler"});
    expect_error([&] { scaler.load_state_dict({{"scale", 2.0}}); }, "has no 'growth_factor'");
  });
}

}  // namespace
