// NOTE: [Grouped attention without expansion] (src/models/llama_kv.cpp):
// attention over the KV cache with fewer KV heads than query heads reads
// each KV head once for its group of query heads, and equals the full
// forward (whose causal attention expands K and V to every head) in float64.
#include "dtp/inference/kv_cache.h"
#include "dtp/models/llama.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

using namespace dtp;
using namespace dtp::models;

namespace {

// The batch sizes (first dim) of the aten::bmm calls on this thread while a
// BmmBatches lives.
thread_local std::vector<int64_t>* g_bmm = nullptr;

std::unique_ptr<at::ObserverContext> recordBmm(const at::RecordFunction& fn) {
  if (g_bmm == nullptr || std::string(fn.name()) != "aten::bmm") return nullptr;
  const auto inputs = fn.inputs();
  if (!inputs.empty() && inputs[0].isTensor()) g_bmm->push_back(inputs[0].toTensor().size(0));
  return nullptr;
}

struct BmmBatches {
  BmmBatches() : handle(at::addThreadLocalCallback(at::RecordFunctionCallback(&recordBmm).needsInputs(true))) {
    g_bmm = &batches;
  }
  ~BmmBatches() {
    g_bmm = nullptr;
    at::removeCallback(handle);
  }
  std::vector<int64_t> batches;
  at::CallbackHandle handle;
};

at::Tensor lastLogits(Llama& model, const std::vector<int64_t>& tokens) {
  at::Tensor t = at::tensor(tokens, at::kLong).view({1, -1});
  return model(t)[0][static_cast<int64_t>(tokens.size()) - 1];
}

}  // namespace

// 8 query heads over 4, 2 and 1 KV heads (n_rep 2, 4, 8), three prompts of
// uneven lengths (the masks of shorter rows), 4 decode steps: every step's
// logits equal a full recompute to 1e-12 (the bound of
// KvCacheTest.DecodeEqualsAFullRecomputeInFloat64, same model scale), and
// the decode steps' products run one batch entry per (sequence, KV head):
// batch 3 x kv heads, never 3 x 8 heads.
TEST(GroupedAttentionTest, CacheDecodeEqualsExpandedFullForwardInFloat64) {
  for (int64_t kv : {4, 2, 1}) {
    SCOPED_TRACE("kv heads " + std::to_string(kv));
    LlamaConfig c;
    c.vocab_size = 67;
    c.dim = 64;
    c.n_layers = 2;
    c.n_heads = 8;
    c.n_kv_heads = kv;
    c.ffn_hidden = 40;
    c.max_seq_len = 32;
    c.seed = 5;
    c.dtype = at::kDouble;
    Llama model(c);
    model->eval();
    at::NoGradGuard no_grad;
    std::vector<std::vector<int64_t>> seqs = {{5, 9, 2}, {1, 2, 3, 4, 5, 6, 7}, {60, 61, 62, 63, 64}};
    KVCache cache(3, 16);
    cache.reset(3);
    at::Tensor tokens = at::zeros({3, 7}, at::kLong);
    std::vector<int64_t> valid;
    for (int64_t b = 0; b < 3; ++b) {
      tokens[b].narrow(0, 0, static_cast<int64_t>(seqs[b].size())).copy_(at::tensor(seqs[b], at::kLong));
      valid.push_back(static_cast<int64_t>(seqs[b].size()));
    }
    at::Tensor logits = model->forward(tokens, cache, valid);
    double worst = 0;
    std::vector<int64_t> decode_batches;
    for (int step = 0; step < 5; ++step) {
      std::vector<int64_t> next;
      for (int64_t b = 0; b < 3; ++b) {
        const at::Tensor want = lastLogits(model, seqs[b]);
        worst = std::max(worst, (logits[b][0] - want).abs().max().item<double>());
        next.push_back(want.argmax().item<int64_t>());
        seqs[b].push_back(next.back());
      }
      if (step < 4) {
        BmmBatches bmm;
        logits = model->forward(at::tensor(next, at::kLong).view({3, 1}), cache, {1, 1, 1});
        decode_batches.insert(decode_batches.end(), bmm.batches.begin(), bmm.batches.end());
      }
    }
    EXPECT_LE(worst, 1e-12) << "cached grouped decode vs the expanded full forward";
    // Two products (scores, then values) per layer per step.
    ASSERT_EQ(decode_batches.size(), static_cast<size_t>(2 * c.n_layers * 4));
    for (int64_t n : decode_batches) EXPECT_EQ(n, 3 * kv) << "a decode product over expanded heads";
    std::printf("grouped cache attention, kv heads %lld of 8, float64: max |diff| against the full forward %.2g\n",
                static_cast<long long>(kv), worst);
  }
}
