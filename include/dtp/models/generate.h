// Generation with the reference Llama: prefill the prompts in one forward,
// then decode one token per step, sampling from the (vocabulary-sharded)
// logits without gathering them when avoidable.
//
//   apply_tensor_parallel_for_inference(model, mesh);   // or one device
//   GenerateOptions o;
//   o.max_new_tokens = 64;
//   o.sampling.temperature = 0.8;
//   o.sampling.top_k = 40;
//   auto out = generate(model, {{1, 450, 7483}, {1, 306}}, o);   // new tokens per prompt
//
// NOTE: [generate on the engine] generate is a client of the serving engine
// (dtp/inference/engine.h), not a decode loop of its own: every rank builds
// an engine without a group (each plans for itself, the same plans, since
// every rank passes the same prompts: checked), enqueues the prompts in
// order and steps until all are done. The engine's options make the first
// step prefill every prompt in one forward ([batch, longest prompt]), and
// each later step decodes one token of every sequence still running, in a
// paged KV cache sized for the batch. Prompt b samples from its own
// generator, seeded GenerateOptions::seed + b (vLLM's seeds for n > 1), so
// a prompt draws the same tokens alone or in any batch.
#pragma once

#include "dtp/inference/sampling.h"
#include "dtp/inference/kv_cache.h"
#include "dtp/models/llama.h"

#include <cstdint>
#include <vector>

namespace dtp::models {

// apply_tensor_parallel for serving: no sequence parallelism, so each
// attention and each MLP costs one all-reduce at any sequence length
// (torchchat's choice for decode), and the head's logits stay
// vocabulary-sharded for sampling.
void apply_tensor_parallel_for_inference(Llama& model, const DeviceMesh& mesh);

struct GenerateOptions {
  int64_t max_new_tokens = 32;
  inference::SamplingOptions sampling;
  uint64_t seed = 0;  // prompt b's generator's is seed + b, the same on every rank
  std::vector<int64_t> stop_tokens;  // a sequence ends after emitting one
  // Check with a collective that every rank picked the same tokens (also
  // on when TORCH_DISTRIBUTED_DEBUG=DETAIL).
  bool check_ranks_agree = false;
};

struct GenerateStats {
  double prefill_ms = 0;
  std::vector<double> decode_ms;  // per decode step
  int64_t decode_collectives = 0;  // over all decode steps, this rank
  int64_t decode_sequences = 0;    // sequences computed, summed over decode steps (finished ones drop out)
};

// The new tokens of each prompt (stop token included when one was hit).
// Collective under TP: every rank of the model's mesh passes the same
// prompts and options, which it checks first (ranks that differ get an
// error naming each rank's value). The longest prompt plus max_new_tokens
// must fit the model's max_seq_len.
std::vector<std::vector<int64_t>> generate(Llama& model, const std::vector<std::vector<int64_t>>& prompts,
                                           const GenerateOptions& options, GenerateStats* stats = nullptr);

// Deprecated (CHANGELOG.md): the form before the engine. `cache` only
// bounds the call as it did (its max_seq the longest prompt plus
// max_new_tokens - 1, its max_batch the prompts); the tokens come from the
// engine's own paged cache. Use the form above. DTP_NO_DEPRECATED hides it,
// as the next release will; the library still defines it
// (src/models/generate.cpp), so that programs built without it link.
#ifndef DTP_NO_DEPRECATED
[[deprecated("use generate(model, prompts, options, stats): the KVCache only bounds the call; removed in the next "
             "release")]] std::vector<std::vector<int64_t>>
generate(Llama& model, KVCache& cache, const std::vector<std::vector<int64_t>>& prompts, const GenerateOptions& options,
         GenerateStats* stats = nullptr);
#endif  // DTP_NO_DEPRECATED

}  // namespace dtp::models
