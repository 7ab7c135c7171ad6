#include "dtp/inference/sampling.h"

#include "dtp/dtensor.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

namespace dtp::inference {
namespace {

// This rank's [B, Vlocal] logits (in their dtype: only candidates are
// converted to float64, the row only when all of it is needed), the vocab
// index of its first
// column, and the group sharing the vocabulary (invalid: not sharded).
struct Shard {
  at::Tensor local;
  int64_t offset = 0, vocab = 0;
  ProcessGroup group;
};

Shard shardOf(const at::Tensor& logits, const char* api) {
  Shard s;
  const int64_t last = logits.dim() - 1;
  if (!is_dtensor(logits)) {
    s.local = logits.reshape({logits.size(0), -1});
    s.vocab = logits.size(last);
    return s;
  }
  const DTensorSpec& spec = dtensor_spec(logits);
  s.vocab = spec.shape.back();
  for (size_t d = 0; d < spec.placements.size(); ++d) {
    const Placement& p = spec.placements[d];
    TORCH_CHECK(!p.is_partial(), api, ": logits ", spec.str(), " are Partial. Redistribute them first.");
    if (!p.is_shard()) continue;
    TORCH_CHECK(p.dim == last || p.dim == -1, api, ": logits ", spec.str(), " are sharded on dim ", p.dim,
                ", expected the vocabulary (last) dim or replicated.");
    TORCH_CHECK(!s.group.valid(), api, ": logits ", spec.str(), " are sharded over two mesh dims. NYI.");
    s.group = spec.mesh.get_group(static_cast<int64_t>(d));
  }
  s.offset = spec.local_offset().back();
  const at::Tensor local = to_local(logits);
  s.local = local.reshape({local.size(0), -1});
  return s;
}

// Each rank's `per_rank` candidates [B, n_r, 2] (logit, vocab index) joined.
at::Tensor gather(const Shard& s, const at::Tensor& mine, const std::vector<int64_t>& per_rank) {
  if (!s.group.valid()) return mine;
  return s.group.all_gather(mine.contiguous(), 1, per_rank).wait();
}

std::vector<int64_t> perRank(const Shard& s, int64_t k) {
  std::vector<int64_t> n;
  const int64_t w = s.group.valid() ? s.group.size() : 1;
  for (int64_t r = 0; r < w; ++r) {
    const int64_t size = w == 1 ? s.vocab : chunk_size(s.vocab, w, r);
    n.push_back(k > 0 ? std::min(k, size) : size);
  }
  return n;
}

// Row b's candidates in the canonical order: logit descending, index ascending.
std::pair<at::Tensor, at::Tensor> canonical(const at::Tensor& cand) {
  at::Tensor idx = cand.select(-1, 1), val = cand.select(-1, 0);
  const at::Tensor byIndex = std::get<1>(idx.sort(-1));
  idx = idx.gather(-1, byIndex);
  val = val.gather(-1, byIndex);
  const at::Tensor byValue = std::get<1>(at::sort(val, /*stable=*/true, -1, /*descending=*/true));
  return {val.gather(-1, byValue), idx.gather(-1, byValue)};
}

// Each row's first candidate in canonical's order, without sorting: the
// largest logit (NaN above all, as sort and argmax order it), the lowest
// vocab index among equals.
std::vector<int64_t> firstOf(const at::Tensor& cand) {
  const at::Tensor c = cand.cpu().contiguous();
  const auto a = c.accessor<double, 3>();
  TORCH_CHECK(a.size(1) > 0, "sample: the logits have an empty vocabulary dim: no token to pick.");
  std::vector<int64_t> out(a.size(0));
  for (int64_t b = 0; b < a.size(0); ++b) {
    int64_t best = 0;
    for (int64_t j = 1; j < a.size(1); ++j) {
      const double v = a[b][j][0], w = a[b][best][0];
      const bool nan = std::isnan(v), best_nan = std::isnan(w);
      const bool tie = nan == best_nan && (nan || v == w);
      if (tie ? a[b][j][1] < a[b][best][1] : nan || (!best_nan && v > w)) best = j;
    }
    out[b] = static_cast<int64_t>(a[b][best][1]);
  }
  return out;
}

}  // namespace

std::vector<int64_t> sample(const at::Tensor& logits, const SamplingOptions& o, at::Generator& gen) {
  TORCH_CHECK(logits.dim() == 2 || (logits.dim() == 3 && logits.size(1) == 1), "sample: logits must be [B, V] or "
              "[B, 1, V], got ", logits.sizes(), ".");
  TORCH_CHECK(o.temperature >= 0 && o.top_k >= 0 && o.top_p > 0 && o.top_p <= 1, "sample: temperature=", o.temperature,
              ", top_k=", o.top_k, ", top_p=", o.top_p, ": expected temperature >= 0, top_k >= 0, 0 < top_p <= 1.");
  TORCH_CHECK(o.temperature == 0.0 || std::isnormal(o.temperature), "sample: temperature=", o.temperature,
              " is subnormal: logits / temperature overflow. Use temperature=0 for greedy decoding.");
  const Shard s = shardOf(logits, "sample");
  const int64_t batch = s.local.size(0), nLocal = s.local.size(1);
  const bool greedy = o.temperature == 0.0;
  const int64_t k = greedy ? 1 : o.top_k;
  const auto sizes = perRank(s, k);
  const int64_t mine = nLocal == 0 ? 0 : (k > 0 ? std::min(k, nLocal) : nLocal);
  at::Tensor cand = at::empty({batch, mine, 2}, at::kDouble);
  if (mine > 0) {
    auto [val, idx] = k == 1   ? s.local.max(-1, /*keepdim=*/true)
                      : k > 0  ? s.local.topk(mine, -1)
                               : std::make_tuple(s.local, at::arange(nLocal, at::kLong).expand({batch, nLocal}));
    cand.select(-1, 0).copy_(val);
    cand.select(-1, 1).copy_(idx.to(at::kDouble) + static_cast<double>(s.offset));
  }
  const at::Tensor all = gather(s, cand, sizes);
  if (greedy) return firstOf(all);
  auto [val, idx] = canonical(all);  // [B, n] each
  std::vector<int64_t> out(batch);
  if (o.top_k > 0 && val.size(1) > o.top_k) {
    val = val.narrow(1, 0, o.top_k);
    idx = idx.narrow(1, 0, o.top_k);
  }
  at::Tensor probs = at::softmax(val / o.temperature, -1);
  TORCH_CHECK(at::isfinite(probs).all().item<bool>(), "sample: softmax(logits / temperature=", o.temperature,
              ") is not finite: the temperature is too small for these logits (they overflow when divided), or the "
              "logits hold NaN or +inf. Use temperature=0 for greedy decoding, or a larger temperature.");
  if (o.top_p < 1.0) {
    // Keep the shortest prefix whose mass reaches top_p (at least one).
    const at::Tensor before = probs.cumsum(-1) - probs;
    probs = probs.masked_fill(before >= o.top_p, 0.0);
  }
  const at::Tensor pick = at::multinomial(probs, 1, /*replacement=*/false, gen);
  const at::Tensor picked = idx.gather(1, pick).cpu().contiguous();  // [B, 1]
  const auto p = picked.accessor<double, 2>();
  for (int64_t b = 0; b < batch; ++b) out[b] = static_cast<int64_t>(p[b][0]);
  return out;
}

// NOTE: [Logprobs in one all-gather]
// log_softmax(x)_i = x_i - lse(x), and the log-sum-exp of a row is the
// log-sum-exp of its shards' log-sum-exps. So each rank packs, per row b,
//   [b, 0]      (lse of its shard, -inf when empty; 0)
//   [b, 1]      (the chosen token's logit; 1) if its shard holds the token,
//               else (0; 0)
//   [b, 2 + j]  (logit; vocab id) of its j-th best, j < min(k, V_r)
// and one all-gather joins the pieces (rank r's of 2 + min(k, V_r) entries);
// every rank then reads the same numbers in the same order. E.g. V = 9 on 4
// ranks (shards 3, 3, 3, 0), k = 2: pieces of 4, 4, 4 and 2 entries. The
// other way (an all-reduce of the max, one of the sum of exp(x - max) and
// the masked chosen logit, an all-gather of the candidates) takes three
// collectives, each a round trip, for the same result. Each shard's best
// are its first in the canonical order (equal logits by lower id), so the
// merged top-k is the whole row's, ties at the cut included.
namespace {

// Row-wise, the first m of x [B, n] (m <= n) in the canonical order, as
// (values, column indices); their order among themselves is not kept.
std::pair<at::Tensor, at::Tensor> bestOf(const at::Tensor& x, int64_t m) {
  auto [val, idx] = x.topk(m, -1);
  // topk breaks ties at the cut in no set order: when a value equal to the
  // m-th was left out (or the cut is NaN), take a stable sort's first m.
  const at::Tensor cut = val.narrow(1, m - 1, 1);
  const bool exact = !at::isnan(cut).any().item<bool>() && (x == cut).sum(-1).equal((val == cut).sum(-1));
  if (exact) return {val, idx};
  auto [sorted, order] = at::sort(x, /*stable=*/true, -1, /*descending=*/true);
  return {sorted.narrow(1, 0, m), order.narrow(1, 0, m)};
}

}  // namespace

std::vector<TokenLogprobs> logprobs(const at::Tensor& logits, const std::vector<int64_t>& tokens, int64_t top_k) {
  TORCH_CHECK(logits.dim() == 2 || (logits.dim() == 3 && logits.size(1) == 1), "logprobs: logits must be [B, V] or "
              "[B, 1, V], got ", logits.sizes(), ".");
  TORCH_CHECK(top_k >= 0 && top_k <= kMaxTopLogprobs, "logprobs: top_k for the top logprobs: got ", top_k,
              ", expected 0 to ", kMaxTopLogprobs, " (OpenAI's limit). Ask for fewer.");
  if (is_dtensor(logits)) {
    const DTensorSpec& spec = dtensor_spec(logits);
    TORCH_CHECK(spec.mesh.ndim() == 1, "logprobs: mesh for logits ", spec.str(), ": got ", spec.mesh.ndim(),
                " dims, expected 1 (the vocabulary's). Pass the logits on a 1-D mesh (e.g. mesh[\"tp\"]) or "
                "to_local() over the other dims.");
  }
  const Shard s = shardOf(logits, "logprobs");
  const int64_t batch = s.local.size(0), nLocal = s.local.size(1);
  TORCH_CHECK(static_cast<int64_t>(tokens.size()) == batch, "logprobs: chosen tokens for logits [", batch, ", ",
              s.vocab, "]: got ", tokens.size(), ", expected one per row (", batch, ").");
  for (size_t b = 0; b < tokens.size(); ++b) {
    TORCH_CHECK(tokens[b] >= 0 && tokens[b] < s.vocab, "logprobs: chosen token of row ", b, ": got ", tokens[b],
                ", expected 0 <= id < ", s.vocab, " (the vocabulary). Pass ids the logits' vocabulary holds.");
  }
  // See NOTE: [Logprobs in one all-gather].
  const std::vector<int64_t> best = perRank(s, top_k);
  std::vector<int64_t> sizes;
  for (int64_t n : best) sizes.push_back(2 + (top_k > 0 ? n : 0));
  const int64_t rank = s.group.valid() ? s.group.rank() : 0;
  const int64_t mine = sizes[rank] - 2;
  at::Tensor piece = at::zeros({batch, 2 + mine, 2}, at::kDouble);
  if (nLocal == 0) {
    piece.select(1, 0).select(-1, 0).fill_(-std::numeric_limits<double>::infinity());
  } else {
    const at::Tensor x = s.local.to(at::kDouble);
    piece.select(1, 0).select(-1, 0).copy_(at::logsumexp(x, {-1}));
    std::vector<int64_t> held;  // the rows whose chosen token this shard holds
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t col = tokens[b] - s.offset;
      if (col >= 0 && col < nLocal) held.push_back(b);
    }
    if (!held.empty()) {
      std::vector<int64_t> cols;
      for (int64_t b : held) cols.push_back(tokens[b] - s.offset);
      const at::Tensor rows = at::tensor(held, at::kLong).to(x.device());
      const at::Tensor chosen = x.index({rows, at::tensor(cols, at::kLong).to(x.device())}).cpu();
      const at::Tensor rowsCpu = at::tensor(held, at::kLong);
      piece.select(1, 1).select(-1, 0).index_copy_(0, rowsCpu, chosen);
      piece.select(1, 1).select(-1, 1).index_fill_(0, rowsCpu, 1.0);
    }
    if (mine > 0) {
      auto [val, idx] = bestOf(x, mine);
      piece.narrow(1, 2, mine).select(-1, 0).copy_(val);
      piece.narrow(1, 2, mine).select(-1, 1).copy_(idx.to(at::kDouble) + static_cast<double>(s.offset));
    }
  }
  const at::Tensor all = gather(s, piece, sizes).cpu().contiguous();  // [B, sum(sizes), 2]
  // Each rank's lse and chosen entries, then the candidates of all ranks.
  std::vector<int64_t> heads, cands;
  int64_t start = 0;
  for (int64_t n : sizes) {
    heads.push_back(start);
    for (int64_t j = 2; j < n; ++j) cands.push_back(start + j);
    start += n;
  }
  const at::Tensor headIdx = at::tensor(heads, at::kLong);
  const at::Tensor lse = at::logsumexp(all.index_select(1, headIdx).select(-1, 0), {-1});  // [B]
  const at::Tensor chosen = all.index_select(1, headIdx + 1);                             // [B, w, 2]
  const int64_t k = std::min(top_k, s.vocab);
  at::Tensor topVal = at::zeros({batch, 0}, at::kDouble), topIdx = topVal;
  if (k > 0) {
    std::tie(topVal, topIdx) = canonical(all.index_select(1, at::tensor(cands, at::kLong)));
    topVal = topVal.narrow(1, 0, k) - lse.unsqueeze(1);
    topIdx = topIdx.narrow(1, 0, k);
  }
  const auto tv = topVal.accessor<double, 2>(), ti = topIdx.accessor<double, 2>();
  const auto l = lse.accessor<double, 1>();
  const auto c = chosen.accessor<double, 3>();
  std::vector<TokenLogprobs> out(batch);
  for (int64_t b = 0; b < batch; ++b) {
    out[b].token = tokens[b];
    int64_t owner = -1;
    for (int64_t r = 0; r < c.size(1); ++r) {
      if (c[b][r][1] == 1.0) owner = r;
    }
    TORCH_INTERNAL_ASSERT(owner >= 0, "logprobs: no rank holds token ", tokens[b], " of row ", b);
    out[b].logprob = c[b][owner][0] - l[b];
    for (int64_t j = 0; j < k; ++j) {
      out[b].top.push_back({static_cast<int64_t>(ti[b][j]), tv[b][j]});
    }
  }
  return out;
}

}  // namespace dtp::inference
