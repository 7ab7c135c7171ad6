// The decoder's families (NOTE: [Model families]): Llama 3 (llama3 rope
// scaling, attention biases), Mistral (sliding window), Qwen 2.5 (q/k/v
// biases, tied) and Qwen 3 (per-head q/k norms, head_dim apart from
// dim / n_heads), each trained under TP (with and without SP), FSDP and DDP
// against one device in float64; KV-cache decode against a full recompute;
// q/k norms without communication; a user plan in place of the default.
// Their logits against an independent Python reference are checked by
// tests/hf (HfInterop.PythonReferenceAndExport).
#include "dist.h"
#include "llama_util.h"

#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/models/generate.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/optim/adamw.h"

#include <functional>
#include <mutex>

using namespace dtp;
using namespace dtp::models;
using dtp::test::expect_error;
using dtp::test::kSeq;
using dtp::test::run_ranks;

namespace {

struct Family {
  const char* name;
  std::function<void(LlamaConfig&)> set;
};

// On small_llama_config (dim 32, 4 heads of 8): the switches of each family,
// sized so that each one matters within kSeq = 8 tokens.
const std::vector<Family>& families() {
  static const std::vector<Family> f = {
      // head_dim 8, wavelengths 2*pi*10000^(2i/8) = 6.3, 63, 628, 6283:
      // original 64 / high 4 = 16 keeps the first, 64 / low 1 = 64 stretches
      // the last two, the second is interpolated.
      {"llama3_bias", [](LlamaConfig& c) {
         c.rope_scaling = {/*factor=*/8.0, /*low_freq_factor=*/1.0, /*high_freq_factor=*/4.0,
                           /*original_max_position_embeddings=*/64};
         c.qkv_bias = c.o_bias = true;
       }},
      {"mistral_window3", [](LlamaConfig& c) {
         c.family = "mistral";
         c.sliding_window = 3;
       }},
      {"qwen2_tied", [](LlamaConfig& c) {
         c.family = "qwen2";
         c.qkv_bias = true;
         c.tie_embeddings = true;
       }},
      {"qwen2_moe_shared_expert", [](LlamaConfig& c) {
         c.family = "qwen2_moe";
         c.qkv_bias = true;
         c.moe.num_experts = 4;
         c.moe.top_k = 2;
         c.moe.hidden = 12;
         c.moe.norm_topk_prob = false;
         c.moe.shared_hidden = 20;
       }},
      {"qwen3_head_dim12", [](LlamaConfig& c) {
         c.family = "qwen3";
         c.qk_norm = true;
         c.explicit_head_dim = 12;
       }},
  };
  return f;
}

LlamaConfig familyConfig(const Family& f, int tp) {
  LlamaConfig c = dtp::test::small_llama_config(tp);
  c.dtype = at::kDouble;
  f.set(c);
  return c;
}

using dtp::test::Trace;

// 3 AdamW steps of the whole batch (dp > 1: this dp rank's half, the loss
// averaged over dp by the data-parallel gradient reduction; the printed
// losses are then each rank's half and are not compared).
Trace train(Llama& model, int64_t dp = 1, int64_t dp_rank = 0) {
  return dtp::test::train_trace(model, 3, [dp, dp_rank](Llama& m, torch::optim::AdamW& opt, int from, int to) {
    return dtp::test::train_llama(m, opt, from, to, dp, dp_rank);
  });
}

// See NOTE: [Float64 parity tolerance] in llama_test.cpp: 3 steps of lr 1e-2
// move a weight by at most 3e-11 for rounding-level gradient differences.
void expectSame(const Trace& got, const Trace& want, bool losses) {
  dtp::test::expect_same_trace(got, want, losses ? std::optional<double>(1e-12) : std::nullopt, 3e-11);
}

TEST(ModelFamilyTest, TrainsLikeOneDeviceInFloat64UnderTpSpFsdpAndDdp) {
  for (const Family& f : families()) {
    SCOPED_TRACE(f.name);
    for (int tp : {2, 4}) {
      const LlamaConfig c = familyConfig(f, tp);
      Llama one(c);
      const Trace want = train(one);
      // The switches are there: a bias, q/k norms, the window.
      EXPECT_EQ(one->layers[0]->as<TransformerBlockImpl>()->attention->wq->bias.defined(), c.qkv_bias);
      EXPECT_EQ(static_cast<bool>(one->layers[0]->as<TransformerBlockImpl>()->attention->q_norm), c.qk_norm);
      for (bool sp : {true, false}) {
        SCOPED_TRACE(c10::str("tp ", tp, sp ? " sp" : " no sp"));
        run_ranks(tp, [&](int) {
          Llama model(c);
          apply_tensor_parallel(model, init_device_mesh("cpu", {tp}, {"tp"}), TensorParallelOptions{sp, kSeq});
          expectSame(train(model), want, /*losses=*/true);
        });
      }
    }
    const LlamaConfig c = familyConfig(f, 2);
    Llama one(c);
    const Trace want = train(one);
    for (bool ddp : {false, true}) {
      SCOPED_TRACE(ddp ? "dp 2 x tp 2, DDP" : "dp 2 x tp 2, FSDP");
      run_ranks(4, [&](int) {
        auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
        Llama model(c);
        apply_tensor_parallel(model, mesh, TensorParallelOptions{/*sequence_parallel=*/true, kSeq});
        if (ddp) apply_ddp(model, mesh);
        else apply_fsdp(model, mesh);
        expectSame(train(model, 2, mesh.get_local_rank("dp")), want, /*losses=*/false);
      });
    }
  }
}

// The logits of the last token of `tokens` by a full forward without cache.
at::Tensor recompute(Llama& model, const std::vector<int64_t>& tokens) {
  at::NoGradGuard no_grad;
  at::Tensor logits = model(at::tensor(tokens, at::kLong).view({1, -1}));
  return logits[0][static_cast<int64_t>(tokens.size()) - 1];
}

// Prefill of 3 prompts (2 to 7 tokens: longer than Mistral's window of 3),
// then 5 greedy decode steps: every step's logits equal a full recompute in
// float64, and TP 2 (the inference plan) picks the same tokens.
TEST(ModelFamilyTest, KvCacheDecodeEqualsAFullRecomputeAndTp2PicksTheSameTokens) {
  const std::vector<std::vector<int64_t>> prompts = {{5, 9}, {1, 2, 3, 4, 5, 6, 7}, {60, 61, 62, 63, 64}};
  for (const Family& f : families()) {
    SCOPED_TRACE(f.name);
    const LlamaConfig c = familyConfig(f, 2);
    Llama model(c);
    GenerateOptions o;
    o.max_new_tokens = 5;
    const auto tokens = generate(model, prompts, o);
    // Decode against the recompute, token by token, with the same cache.
    double worst = 0;
    at::NoGradGuard no_grad;
    for (size_t b = 0; b < prompts.size(); ++b) {
      KVCache one(1, 16);
      one.reset(1);
      std::vector<int64_t> seq = prompts[b];
      at::Tensor logits = model->forward(at::tensor(seq, at::kLong).view({1, -1}), one, {static_cast<int64_t>(seq.size())});
      for (int step = 0; step < 5; ++step) {
        const at::Tensor want = recompute(model, seq);
        worst = std::max(worst, (logits[0][0] - want).abs().max().item<double>());
        seq.push_back(want.argmax().item<int64_t>());
        EXPECT_EQ(seq.back(), tokens[b][step]) << "sequence " << b << " step " << step;
        logits = model->forward(at::tensor({seq.back()}, at::kLong).view({1, 1}), one, {1});
      }
    }
    EXPECT_LE(worst, 1e-12) << "cached decode vs full recompute";
    std::mutex mu;
    run_ranks(2, [&](int rank) {
      Llama tp_model(c);
      apply_tensor_parallel_for_inference(tp_model, init_device_mesh("cpu", {2}, {"tp"}));
      const auto got = generate(tp_model, prompts, o);
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_EQ(got, tokens) << "rank " << rank;
    });
  }
}

// Qwen 3's q/k norms run on each rank's heads: the forward issues exactly the
// collectives of the same model without them, and the backward reduces their
// weights' Partial gradients like the SP norms' (checked by the training test).
TEST(ModelFamilyTest, QkNormsAddNoCollectivesToTheForward) {
  const Family& qwen3 = families().back();
  for (bool sp : {true, false}) {
    SCOPED_TRACE(sp ? "sp" : "no sp");
    run_ranks(2, [&](int) {
      auto count = [&](LlamaConfig c) {
        Llama model(c);
        apply_tensor_parallel(model, init_device_mesh("cpu", {2}, {"tp"}), TensorParallelOptions{sp, kSeq});
        at::Tensor batch = dtp::test::llama_batch(c.vocab_size, 0);
        CommCounter comm;
        at::NoGradGuard no_grad;
        model(batch.narrow(1, 0, kSeq));
        return comm.total_count();
      };
      LlamaConfig with = familyConfig(qwen3, 2), without = with;
      without.qk_norm = false;
      EXPECT_EQ(count(with), count(without));
    });
  }
}

// A user's plan replaces llama_tp_plan's: here the default without the MLP's
// entries, so the MLP stays replicated, and the model still equals one device.
TEST(ModelFamilyTest, AUserPlanReplacesTheDefault) {
  const LlamaConfig c = familyConfig(families().back(), 2);
  Llama one(c);
  const Trace want = train(one);
  run_ranks(2, [&](int) {
    TensorParallelOptions o{/*sequence_parallel=*/false};
    ParallelizePlan plan;
    for (const PlanEntry& e : llama_tp_plan(c, 2, o)) {
      if (e.pattern.find("feed_forward") == std::string::npos) plan.push_back(e);
    }
    ASSERT_LT(plan.size(), llama_tp_plan(c, 2, o).size());
    o.plan = plan;
    Llama model(c);
    apply_tensor_parallel(model, init_device_mesh("cpu", {2}, {"tp"}), o);
    auto* block = model->layers[0]->as<TransformerBlockImpl>();
    EXPECT_TRUE(placements(block->feed_forward->w1->weight).at(0).is_replicate()) << "the MLP stays replicated";
    EXPECT_TRUE(placements(block->attention->wq->weight).at(0).is_shard()) << "wq is sharded";
    expectSame(train(model), want, /*losses=*/true);
  });
}

TEST(ModelFamilyTest, BadSwitchesAreNamedErrors) {
  LlamaConfig c = dtp::test::small_llama_config(2);
  c.rope_scaling.factor = 8.0;
  c.rope_scaling.low_freq_factor = 4.0;  // not below high_freq_factor
  expect_error([&] { c.validate(); }, {"rope_scaling", "low_freq_factor < high_freq_factor"});
  c = dtp::test::small_llama_config(2);
  c.sliding_window = -1;
  expect_error([&] { c.validate(); }, {"sliding_window=-1", "is negative"});
  c = dtp::test::small_llama_config(2);
  c.dim = 30;  // 4 heads do not divide it, but an explicit head_dim makes it fine
  expect_error([&] { c.validate(); }, {"dim=30 is not divisible by n_heads=4", "explicit_head_dim"});
  c.explicit_head_dim = 8;
  c.validate();
  Llama model(c);
  EXPECT_EQ(model->layers[0]->as<TransformerBlockImpl>()->attention->wq->weight.sizes(), at::IntArrayRef({32, 30}));
}

}  // namespace
