// What the serving engine's tests share (engine_test.cpp,
// prefix_cache_test.cpp): the tiny float64 Llama (vocabulary 256 for
// ByteTokenizer's ids, 4 query heads over 2 KV heads), the greedy
// reference without any cache, and request options.
#pragma once

#include "llama_util.h"

#include "dtp/inference/engine.h"
#include "dtp/models/llama.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace dtp::test {

inline models::LlamaConfig tiny_engine_llama(int64_t max_seq_len) {
  models::LlamaConfig c = small_llama_config(/*tp=*/2);  // 4 query heads over 2 KV heads
  c.vocab_size = 256;  // ByteTokenizer's ids
  c.max_seq_len = max_seq_len;
  c.seed = 3;
  c.dtype = at::kDouble;
  return c;
}

// The n greedy tokens after `seq`, on one device: each the argmax of a full
// forward over the sequence so far, without any cache.
inline std::vector<int64_t> greedy_by_recompute(models::Llama& model, std::vector<int64_t> seq, int64_t n) {
  at::NoGradGuard no_grad;
  std::vector<int64_t> out;
  for (int64_t k = 0; k < n; ++k) {
    at::Tensor logits = model(at::tensor(seq, at::kLong).view({1, -1}));
    out.push_back(logits[0][static_cast<int64_t>(seq.size()) - 1].argmax().item<int64_t>());
    seq.push_back(out.back());
  }
  return out;
}

inline inference::RequestOptions greedy_request(int64_t max_tokens) {
  inference::RequestOptions o;
  o.max_tokens = max_tokens;
  return o;
}

// Temperature 0.9, top-k 10, top-p 0.8 from its own generator.
inline inference::RequestOptions seeded_request(uint64_t seed, int64_t max_tokens) {
  inference::RequestOptions o = greedy_request(max_tokens);
  o.sampling.temperature = 0.9;
  o.sampling.top_k = 10;
  o.sampling.top_p = 0.8;
  o.seed = seed;
  return o;
}

}  // namespace dtp::test
