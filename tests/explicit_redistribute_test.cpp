// The explicit-redistribution mode (#27): a redistribution that sharding
// propagation would insert on its own, at the cost of a collective, is an
// error (or one warning per op and input specs); ones a user or a style asks
// for are not; and the reference Llama's plans run clean under it, in a
// training step (with and without sequence parallelism, on 2 and 4 ranks)
// and in generation (the engine's paged KV cache).
#include "close.h"
#include "dist.h"
#include "llama_util.h"
#include "parity.h"

#include "dtp/explicit_redistribute.h"
#include "dtp/models/generate.h"
#include "dtp/models/parallelize.h"

#include <memory>

using namespace dtp;
using namespace dtp::models;
using dtp::test::data;
using dtp::test::expect_error;
using dtp::test::run_ranks;

namespace {

TEST(ExplicitRedistribute, ImplicitCollectivesAreNamedErrorsOrOneWarning) {
  run_ranks(2, [](int) {
    at::NoGradGuard no_grad;
    const auto mesh = init_device_mesh("cpu", {2});
    const at::Tensor a = distribute_tensor(data({4, 6}), mesh, {Shard(0)});
    const at::Tensor b = distribute_tensor(data({4, 6}, 0.5), mesh, {Shard(1)});
    const at::Tensor want = data({4, 6}) + data({4, 6}, 0.5);
    {
      ExplicitRedistributeGuard strict;
      expect_error([&] { (void)(a + b); },
                   {"aten::add.Tensor would redistribute implicitly", "f64[4,6](S(", "all_to_all on mesh dim 0",
                    "192 B global", "dtp::redistribute"});
      // Asked for: allowed, and then the add needs nothing.
      const at::Tensor c = a + redistribute(b, mesh, {Shard(0)});
      EXPECT_CLOSE(full_tensor(c), want, 0.0, 0.0);
      // Free changes are not flagged: R to a shard is a local slice.
      const at::Tensor r = distribute_tensor(data({4, 6}, 0.5), mesh, {Replicate()});
      EXPECT_CLOSE(full_tensor(a + r), want, 0.0, 0.0);
    }
    {
      // Warned (once per op and input specs), and run.
      ExplicitRedistributeGuard warn(ExplicitRedistributeMode::Warn);
      EXPECT_CLOSE(full_tensor(a + b), want, 0.0, 0.0);
    }
    // Outside the guard (and without DTP_EXPLICIT_REDISTRIBUTE) it is off.
    EXPECT_CLOSE(full_tensor(a + b), want, 0.0, 0.0);
  });
}

// Guards destroyed out of order (held on the heap) left the mode of the
// one destroyed first behind; now the innermost live guard decides.
TEST(ExplicitRedistribute, GuardsDestroyedOutOfOrderLeaveNoModeBehind) {
  EXPECT_EQ(ExplicitRedistributeGuard::mode(), ExplicitRedistributeMode::Off);
  auto strict = std::make_unique<ExplicitRedistributeGuard>(ExplicitRedistributeMode::Error);
  auto warn = std::make_unique<ExplicitRedistributeGuard>(ExplicitRedistributeMode::Warn);
  EXPECT_EQ(ExplicitRedistributeGuard::mode(), ExplicitRedistributeMode::Warn);
  strict.reset();
  EXPECT_EQ(ExplicitRedistributeGuard::mode(), ExplicitRedistributeMode::Warn);
  warn.reset();
  EXPECT_EQ(ExplicitRedistributeGuard::mode(), ExplicitRedistributeMode::Off) << "a destroyed guard's mode stuck";
}

class ExplicitRedistributeLlama : public ::testing::TestWithParam<int> {};

TEST_P(ExplicitRedistributeLlama, TrainingStepsAndGenerationRunClean) {
  const int w = GetParam();
  run_ranks(w, [&](int) {
    const auto mesh = init_device_mesh("cpu", {w}, {"tp"});
    for (bool sp : {true, false}) {
      SCOPED_TRACE(sp ? "sequence parallel" : "no sequence parallel");
      LlamaConfig c = dtp::test::small_llama_config(w);
      c.dtype = at::kDouble;
      Llama model(c);
      TensorParallelOptions o;
      o.sequence_parallel = sp;
      apply_tensor_parallel(model, mesh, o);
      torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
      ExplicitRedistributeGuard strict;
      EXPECT_NO_THROW(dtp::test::train_llama(model, opt, 0, 2));
    }
    LlamaConfig c = dtp::test::small_llama_config(w);
    c.n_kv_heads = 2;  // at 4 ranks: replicated KV heads
    Llama model(c);
    apply_tensor_parallel_for_inference(model, mesh);
    GenerateOptions g;
    g.max_new_tokens = 6;
    g.sampling.top_k = 5;
    g.sampling.temperature = 0.8;
    ExplicitRedistributeGuard strict;
    EXPECT_NO_THROW(generate(model, {{1, 2, 3}, {4, 5}}, g));
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, ExplicitRedistributeLlama, ::testing::Values(2, 4),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

}  // namespace
