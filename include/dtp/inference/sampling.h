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
// logprobs() reads the log-softmax of such logits at chosen and top-k tokens
// with one all-gather of a few values per rank and row.
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

// OpenAI's limit on top_logprobs (chat) and logprobs (completions).
constexpr int64_t kMaxTopLogprobs = 20;

struct TopLogprob {
  int64_t token = 0;
  double logprob = 0.0;
};

struct TokenLogprobs {
  int64_t token = 0;            // the chosen token
  double logprob = 0.0;         // its log-probability
  std::vector<TopLogprob> top;  // the min(top_k, V) best, see logprobs()
};

// The log-softmax of each row of logits ([B, V] or [B, 1, V], plain, a
// replicated DTensor, or one sharded on its last dim over a 1-D mesh), read
// at the chosen token of each row (tokens: B ids in [0, V)) and at the row's
// top_k best tokens (0 <= top_k <= kMaxTopLogprobs), computed in float64.
// `top` is ordered by logprob descending, equal logprobs by lower token id
// (the order sample() puts candidates in); it holds min(top_k, V) entries.
//
// Without gathering the logits (NOTE: [Logprobs in one all-gather] in
// sampling.cpp): each rank sends, per row, its shard's log-sum-exp, the
// chosen token's logit if its shard holds it, and its min(top_k, V_r) best
// (logit, id); one all-gather of B x (2 + min(top_k, V_r)) x 2 doubles per
// rank r. Collectives: exactly 1 all-gather when the vocabulary is sharded
// over more than one rank, none otherwise. A collective then: every rank of
// the mesh calls it with the same tokens and top_k.
std::vector<TokenLogprobs> logprobs(const at::Tensor& logits, const std::vector<int64_t>& tokens, int64_t top_k);

}  // namespace dtp::inference
