// Sampling the next token from logits that may be vocabulary-sharded
// (the Colwise head's S(-1) output), without gathering [batch, vocab] when it
// can be avoided:
//   greedy         each rank's max and its index, one all-gather of
//                  [batch, 2] per rank;
//   top-k          each rank's k best, one all-gather, merged;
//   temperature    with no top-k: the whole row is needed (one all-gather).
// Candidates are put in one order on every rank (logit descending, vocab
// index ascending) before top-p and the draw, so every rank, and every TP
// degree, draws the same token from the same generator state.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace dtp::inference {

struct SamplingOptions {
  double temperature = 0.0;  // 0: greedy
  int64_t top_k = 0;         // 0: no top-k
  double top_p = 1.0;        // 1: no nucleus cut
};

// logits: [B, V] or [B, 1, V], plain or a DTensor sharded on its last dim
// (or replicated). Returns B token ids; a collective under TP (every rank of
// the vocabulary's mesh dim calls it with the same generator state).
std::vector<int64_t> sample(const at::Tensor& logits, const SamplingOptions& options, at::Generator& gen);

}  // namespace dtp::inference
