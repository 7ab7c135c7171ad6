// The reference Llama under apply_tensor_parallel against the same model on
// one device: 3 AdamW steps with SP, without SP, with tied embeddings and with
// dropout, on 2 and 4 ranks; exact forward collective counts; a pipeline
// stage; and every validation error.
#include "dist.h"
#include "llama_util.h"

#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/models/llama.h"
#include "dtp/random.h"

#include "dtp/optim/adamw.h"

using namespace dtp;
using namespace dtp::models;
using dtp::test::kBatch;
using dtp::test::kSeq;
using dtp::test::run_ranks;

namespace {

struct Variant {
  bool sp = true, tied = false;
  double dropout = 0.0;
};

LlamaConfig smallConfig(int tp, const Variant& v) {
  LlamaConfig c = dtp::test::small_llama_config(tp);
  c.tie_embeddings = v.tied;
  c.dropout = v.dropout;
  return c;
}

struct Trace {
  std::vector<double> losses;
  std::vector<std::pair<std::string, at::Tensor>> params;  // full
};

constexpr int kSteps = 3;

Trace train(Llama& model) {
  dtp::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
  Trace t;
  t.losses = dtp::test::train_llama(model, opt, 0, kSteps);
  t.params = dtp::test::full_named_params(model);
  return t;
}

// Dropout masks come from at::'s default generator on one device and from
// dtp's generator for DTensors: seeded alike right before training.
Trace reference(const LlamaConfig& c) {
  Llama model(c);
  at::manual_seed(123);
  return train(model);
}

// Losses agree to 1e-5. Sharded matmuls sum in another order than one
// device's, and AdamW divides by sqrt(v): a weight whose gradient is near
// zero moves by up to 1.1e-5 (one element in 1280 here), so weights get 2e-5.
void expectSame(const Trace& got, const Trace& want) {
  constexpr double tol = 1e-5, param_tol = 2e-5;
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < got.losses.size(); ++i) EXPECT_NEAR(got.losses[i], want.losses[i], tol) << "step " << i;
  ASSERT_EQ(got.params.size(), want.params.size());
  for (size_t i = 0; i < got.params.size(); ++i) {
    EXPECT_EQ(got.params[i].first, want.params[i].first);
    EXPECT_TRUE(got.params[i].second.allclose(want.params[i].second, param_tol, param_tol))
        << got.params[i].first << " differs by " << (got.params[i].second - want.params[i].second).abs().max();
  }
}

class LlamaTpTest : public ::testing::TestWithParam<int> {};

TEST_P(LlamaTpTest, TrainsLikeOneDeviceInEveryVariant) {
  const int w = GetParam();
  for (Variant v : {Variant{true, false, 0.0}, Variant{false, false, 0.0}, Variant{true, true, 0.0},
                    Variant{true, false, 0.1}, Variant{false, true, 0.1}}) {
    SCOPED_TRACE(std::string("sp=") + (v.sp ? "1" : "0") + " tied=" + (v.tied ? "1" : "0") +
                 " dropout=" + std::to_string(v.dropout));
    const LlamaConfig c = smallConfig(w, v);
    const Trace want = reference(c);
    run_ranks(w, [&](int) {
      auto mesh = init_device_mesh("cpu", {w}, {"tp"});
      Llama model(c);
      apply_tensor_parallel(model, mesh, TensorParallelOptions{v.sp, kSeq});
      dtp::manual_seed(123);
      if (v.tied) EXPECT_TRUE(model->output->weight.is_same(model->tok_embeddings->weight));
      expectSame(train(model), want);
    });
  }
}

// Forward collectives are exactly Megatron's: per layer 2 all-gathers and 2
// reduce-scatters with SP (2 all-reduces without), plus the embedding, the
// head's gather and loss_parallel's 3 all-reduces.
TEST_P(LlamaTpTest, ForwardCollectivesMatchTheory) {
  const int w = GetParam();
  run_ranks(w, [&](int) {
    auto mesh = init_device_mesh("cpu", {w}, {"tp"});
    for (bool sp : {true, false}) {
      LlamaConfig c = smallConfig(w, {});
      Llama model(c);
      apply_tensor_parallel(model, mesh, TensorParallelOptions{sp, kSeq});
      at::Tensor batch = dtp::test::llama_batch(c.vocab_size, 0);
      CommCounter comm;
      at::Tensor loss = llama_loss(model(batch.narrow(1, 0, kSeq)), batch.narrow(1, 1, kSeq));
      const int64_t L = c.n_layers;
      if (sp) {
        EXPECT_EQ(comm.count(CollectiveType::AllGather), 2 * L + 1) << comm.str();
        EXPECT_EQ(comm.count(CollectiveType::ReduceScatter), 2 * L + 1) << comm.str();
        EXPECT_EQ(comm.count(CollectiveType::AllReduce), 3) << comm.str();
        EXPECT_EQ(comm.total_count(), 4 * L + 5) << comm.str();
      } else {
        EXPECT_EQ(comm.count(CollectiveType::AllReduce), 2 * L + 4) << comm.str();
        EXPECT_EQ(comm.total_count(), 2 * L + 4) << comm.str();
      }
      loss.backward();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, LlamaTpTest, ::testing::Values(2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

// A TP degree of 1 (a debugging run, or the tp dim of a dp x 1 mesh) trains
// like one device and communicates nothing, loss_parallel included.
TEST(LlamaTpDegreeOneTest, TrainsLikeOneDeviceWithoutCollectives) {
  for (bool sp : {true, false}) {
    SCOPED_TRACE(sp ? "sp" : "no sp");
    const LlamaConfig c = smallConfig(1, {});
    const Trace want = reference(c);
    run_ranks(1, [&](int) {
      auto mesh = init_device_mesh("cpu", {1}, {"tp"});
      Llama model(c);
      apply_tensor_parallel(model, mesh, TensorParallelOptions{sp, kSeq});
      dtp::manual_seed(123);
      CommCounter comm;
      expectSame(train(model), want);
      EXPECT_EQ(comm.total_count(), 0) << comm.str();
    });
  }
}

TEST(LlamaTpStageTest, PipelineStageGetsTpWithoutSp) {
  LlamaConfig c = smallConfig(2, {});
  c.with_embedding = false;
  c.with_head = false;
  const at::Tensor x = at::sin(at::arange(kBatch * kSeq * c.dim, at::kFloat)).view({kBatch, kSeq, c.dim});
  Llama ref(c);
  const at::Tensor want = ref(x);
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"tp"});
    Llama model(c);
    apply_tensor_parallel(model, mesh);  // SP requested, but a stage cannot take it
    EXPECT_EQ(placements(model->layers->at<TransformerBlockImpl>(0).attention->wq->weight), Placements{Shard(0)});
    EXPECT_EQ(placements(model->layers->at<TransformerBlockImpl>(0).attention_norm->weight), Placements{Replicate()});
    CommCounter comm;
    at::Tensor y = model(x);
    EXPECT_FALSE(is_dtensor(y));
    EXPECT_EQ(comm.count(CollectiveType::AllReduce), 2 * c.n_layers) << comm.str();
    EXPECT_TRUE(y.allclose(want, 1e-5, 1e-5));
  });
}


TEST(LlamaTpValidationTest, EveryBadSizeIsNamedBeforeAnythingChanges) {
  run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    LlamaConfig c = smallConfig(2, {});
    c.n_heads = 2;
    c.n_kv_heads = 1;
    {
      Llama model(c);
      dtp::test::expect_error([&] { apply_tensor_parallel(model, mesh); }, {"n_kv_heads=1", "tp degree 2"});
      EXPECT_FALSE(is_dtensor(model->output->weight));  // nothing changed
    }
    auto mesh4 = init_device_mesh("cpu", {4}, {"tp"});
    c.n_heads = 6;
    c.dim = 36;
    c.n_kv_heads = 6;
    {
      Llama model(c);
      dtp::test::expect_error([&] { apply_tensor_parallel(model, mesh4); }, {"n_heads=6", "tp degree 4"});
    }
    c = smallConfig(2, {});
    {
      Llama model(c);
      dtp::test::expect_error([&] { apply_tensor_parallel(model, mesh, TensorParallelOptions{true, 7}); },
                  {"seq_len=7", "--no-sp"});
      apply_tensor_parallel(model, mesh, TensorParallelOptions{false, 7});  // fine without SP
      EXPECT_TRUE(is_dtensor(model->output->weight));
    }
    {
      Llama model(c);
      auto dp_only = init_device_mesh("cpu", {4}, {"dp"});
      EXPECT_FALSE(get_tp_mesh(dp_only).has_value());
      apply_tensor_parallel(model, dp_only);  // warns, leaves the model alone
      EXPECT_FALSE(is_dtensor(model->output->weight));
    }
  });
  LlamaConfig bad;
  bad.n_heads = 3;
  dtp::test::expect_error([&] { Llama m(bad); }, {"dim=128", "n_heads=3"});
}

}  // namespace
