// What the serving engine (dtp/inference/engine.h) needs of a model: a
// forward over a paged KV cache and the size of that cache's entries. The
// reference Llama and its families provide one (models::engine_model in
// dtp/models/engine_model.h); another decoder implements these four calls.
#pragma once

#include "dtp/inference/kv_cache.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace dtp::inference {

// One layer's keys (or values) per token on this rank.
struct KvShape {
  int64_t layers = 0;
  int64_t local_heads = 0;    // KV heads this rank holds
  int64_t largest_share = 0;  // the most KV heads any rank holds: every rank sizes its pool by it
  int64_t head_dim = 0;
  at::ScalarType dtype = at::kFloat;
  c10::Device device = c10::Device(c10::kCPU);
};

class Model {
 public:
  virtual ~Model() = default;
  // tokens [B, S] (right-padded), valid[b] of row b's tokens real, cache
  // holding the batch (KVCache::set_batch). Returns the logits of each row's
  // last valid token, [B, 1, V]: plain, or a DTensor sharded on V (the
  // engine samples it without gathering, dtp/inference/sampling.h).
  // Collective under TP: every rank of the model runs the same call.
  virtual at::Tensor forward(const at::Tensor& tokens, KVCache& cache, const std::vector<int64_t>& valid) = 0;
  virtual KvShape kv_shape() const = 0;
  virtual int64_t vocab_size() const = 0;   // ids of a prompt are below it
  virtual int64_t max_seq_len() const = 0;  // positions the model can attend
  // forward calls so far that ran as a prefill sharded over a
  // context-parallel group (EngineMetrics::context_parallel_prefills); 0
  // for a model without one.
  virtual int64_t context_parallel_prefills() const { return 0; }
  // The ranks the paged cache's blocks spread over (KVCache::shard_blocks;
  // NOTE: [KV cache sharded over cp] in kv_cache.h): ranks that run every
  // forward together, each holding 1/size of the blocks. Invalid (the
  // default): every rank holds every block.
  virtual ProcessGroup kv_cache_group() const { return {}; }
};

}  // namespace dtp::inference
