// A KV cache for the reference Llama: per layer, this rank's KV heads of
// every cached token, preallocated for max_batch x max_seq on first use.
//
//   models::KVCache cache(/*max_batch=*/4, /*max_seq=*/256);
//   at::Tensor logits = model->forward(prompts, cache, lengths);   // prefill: [B, 1, vocab]
//   logits = model->forward(next_tokens, cache, {1, 1, 1, 1});     // decode: one token each
//
// NOTE: [KV cache positions] Sequence b's tokens sit at positions
// lengths()[b], lengths()[b] + 1, ... of this call (its own rotary offset);
// a call writes all S positions of its [B, S] tokens (right padding
// included) but advances lengths()[b] by valid[b] only, so the next call
// overwrites the padding. A query at position p attends keys 0..p of its own
// sequence, so padding never reaches a valid token.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace dtp::models {

class KVCache {
 public:
  KVCache(int64_t max_batch, int64_t max_seq);

  int64_t max_batch() const { return max_batch_; }
  int64_t max_seq() const { return max_seq_; }
  // Tokens cached per sequence of the current batch.
  const std::vector<int64_t>& lengths() const { return lengths_; }
  // Starts a new batch of `batch` empty sequences (memory is kept).
  void reset(int64_t batch);
  // Keeps only the sequences `rows` (ascending indices into the current
  // batch), moved to its front in that order: generation drops finished
  // sequences so that they stop costing compute.
  void keep(const std::vector<int64_t>& rows);

  // Used by the Llama's forward (see llama_kv.cpp).
  struct Step {
    std::vector<int64_t> start;  // lengths() before the call
    at::Tensor positions;        // [B, S] i64: start[b] + s
    int64_t keys = 0;            // max(start) + S: keys attended
  };
  // The layer's cache, allocated like `like` ([B, S, kv_heads, head_dim]).
  std::pair<at::Tensor, at::Tensor> layer(int64_t index, const at::Tensor& like);
  void begin(const std::vector<int64_t>& valid, int64_t seq);
  void end(const std::vector<int64_t>& valid);
  const Step& step() const { return step_; }
  // The cache of the forward running on this thread (nullptr: none).
  static KVCache* active();
  struct Activate {
    explicit Activate(KVCache* c);
    ~Activate();
    KVCache* prev;
  };

 private:
  int64_t max_batch_, max_seq_;
  std::vector<int64_t> lengths_;
  std::vector<at::Tensor> k_, v_;
  Step step_;
};

}  // namespace dtp::models
