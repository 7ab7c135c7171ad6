// The reference Llama's attention under context parallelism (src/models/llama_cp.cpp).
#pragma once

#include "dtp/models/llama.h"

#include <memory>
#include <vector>

namespace dtp::models::detail {

// Rotary embeddings at the layout's global positions, then ring or
// all-to-all attention over a.context_parallel's group, causal. q [batch,
// S_local, heads, head_dim], k and v [batch, S_local, kv_heads, head_dim]
// -> [batch, S_local, heads * head_dim]. See NOTE: [Context parallelism in
// the Llama].
at::Tensor context_parallel_attention(const AttentionImpl& a, at::Tensor q, at::Tensor k, at::Tensor v);

// pipeline_llama under context parallelism: makes `stages` (this rank's,
// each parallelized with its own state) and `whole` (the model they were
// cut from) share stages[0]'s state, so that context_parallel_shard_batch on
// the whole model sets the global length every stage's attention reads.
// Returns that state. See NOTE: [Context parallelism in a pipeline].
std::shared_ptr<ContextParallelState> share_context_parallel(Llama whole, const std::vector<Llama>& stages);

// While one is alive on this thread, context_parallel_attention records each
// layer's rotated keys and its values, this rank's positions [B, S_local,
// kv_heads, head_dim], by layer index (NOTE: [Context-parallel prefill] in
// src/models/llama_cp_prefill.cpp).
class KvCapture {
 public:
  KvCapture();
  ~KvCapture();
  KvCapture(const KvCapture&) = delete;
  KvCapture& operator=(const KvCapture&) = delete;
  static KvCapture* active();
  void record(int64_t layer, const at::Tensor& keys, const at::Tensor& values);
  std::vector<at::Tensor> k, v;

 private:
  KvCapture* prev_;
};

// The KV-cache forward of a model with context parallelism (engine_model's):
// a fresh prefill over cp, anything else as without cp. See NOTE:
// [Context-parallel prefill]. `over_cp`, where given, says which it was.
at::Tensor context_parallel_cached_forward(Llama& model, const at::Tensor& tokens, KVCache& cache,
                                           const std::vector<int64_t>& valid, bool* over_cp = nullptr);

}  // namespace dtp::models::detail
