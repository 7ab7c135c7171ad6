// Deferred initialization: the reference Llama built on the meta device,
// parallelized (TP, AC, FSDP or DDP), then init_weights: every parameter
// equals a one-device init bit for bit, and training matches one device.
#include "close.h"
#include "dist.h"
#include "llama_util.h"

#include "dtp/dtensor.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/optim/adamw.h"
#include "dtp/random.h"

using namespace dtp;
using namespace dtp::models;
using dtp::test::kSeq;
using dtp::test::run_ranks;

namespace {

LlamaConfig deferred(LlamaConfig c) {
  c.deferred_init = true;
  return c;
}

void expectEqualParams(const std::vector<std::pair<std::string, at::Tensor>>& got,
                       const std::vector<std::pair<std::string, at::Tensor>>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].first, want[i].first);
    EXPECT_TRUE(got[i].second.equal(want[i].second)) << got[i].first;
  }
}

TEST(DeferredInit, OneDeviceEqualsTheEagerInit) {
  for (bool tied : {false, true})
    for (auto dtype : {at::kFloat, at::kDouble}) {
      LlamaConfig c = dtp::test::small_llama_config(2);
      c.tie_embeddings = tied;
      c.dtype = dtype;
      Llama eager(c);
      Llama lazy(deferred(c));
      for (const auto& p : lazy->parameters()) EXPECT_TRUE(p.is_meta()) << "no memory before init_weights";
      // The embedding and the head are made on meta directly, not built and
      // moved: the same shapes, gradients and options as built whole.
      const auto lazyParams = lazy->named_parameters(), eagerParams = eager->named_parameters();
      ASSERT_EQ(lazyParams.size(), eagerParams.size());
      for (const auto& item : eagerParams) {
        ASSERT_TRUE(lazyParams.contains(item.key())) << item.key();
        EXPECT_EQ(lazyParams[item.key()].sizes(), item.value().sizes()) << item.key();
        EXPECT_EQ(lazyParams[item.key()].requires_grad(), item.value().requires_grad()) << item.key();
      }
      EXPECT_EQ(lazy->output->options.out_features(), c.vocab_size);
      EXPECT_EQ(lazy->tok_embeddings->options.num_embeddings(), c.vocab_size);
      dtp::test::expect_error([&] { lazy(dtp::test::llama_batch(c.vocab_size, 0)); }, {"init_weights", "deferred_init"});
      init_weights(lazy);
      expectEqualParams(dtp::test::full_named_params(lazy), dtp::test::full_named_params(eager));
      if (tied) EXPECT_TRUE(lazy->output->weight.is_same(lazy->tok_embeddings->weight));
      dtp::test::expect_error([&] { init_weights(lazy); }, {"init_weights: the model holds its weights already", "Drop this call"});
    }
}

// Each rank holds only its shards from the start; after init_weights the
// full parameters equal the eager one-device init, and 3 AdamW steps
// (float64, dropout) equal one device's.
TEST(DeferredInit, ParallelizedEqualsOneDeviceAndTrainsLikeIt) {
  LlamaConfig c = dtp::test::small_llama_config(2);
  c.dtype = at::kDouble;
  c.dropout = 0.1;
  c.tie_embeddings = true;
  Llama one(c);
  const auto init = dtp::test::full_named_params(one);
  dtp::optim::AdamW one_opt(one->unique_parameters(), torch::optim::AdamWOptions(1e-2));
  at::manual_seed(3);
  const auto want_losses = dtp::test::train_llama(one, one_opt, 0, 3);
  const auto want = dtp::test::full_named_params(one);
  for (const char* how : {"tp", "fsdp+ac", "ddp"}) {
    SCOPED_TRACE(how);
    const bool tp_only = std::string(how) == "tp";
    run_ranks(tp_only ? 2 : 4, [&](int) {
      auto mesh = tp_only ? init_device_mesh("cpu", {2}, {"tp"}) : init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
      Llama model(deferred(c));
      apply_tensor_parallel(model, mesh, TensorParallelOptions{true, kSeq});
      for (const auto& p : model->unique_parameters()) {
        ASSERT_TRUE(is_dtensor(p));
        EXPECT_FALSE(to_local(p.detach()).is_meta());
        EXPECT_EQ(to_local(p.detach()).sizes(), c10::IntArrayRef(dtensor_spec(p).local_sizes)) << "only the shard";
      }
      if (std::string(how) == "fsdp+ac") {
        apply_ac(model, ACOptions{ACMode::Full, 1});
        apply_fsdp(model, mesh);
      }
      if (std::string(how) == "ddp") apply_ddp(model, mesh);
      init_weights(model);
      expectEqualParams(dtp::test::full_named_params(model), init);
      if (tp_only) {  // training parity (the data-parallel ones: data_parallel_test.cpp)
        dtp::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
        dtp::manual_seed(3);
        const auto losses = dtp::test::train_llama(model, opt, 0, 3);
        for (size_t i = 0; i < losses.size(); ++i) EXPECT_NEAR(losses[i], want_losses[i], 1e-12);
        const auto got = dtp::test::full_named_params(model);
        for (size_t i = 0; i < got.size(); ++i)
          EXPECT_CLOSE(got[i].second, want[i].second, 0.0, 3e-11) << got[i].first;
      }
    });
  }
}

}  // namespace
