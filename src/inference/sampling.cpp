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

Shard shardOf(const at::Tensor& logits) {
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
    TORCH_CHECK(!p.is_partial(), "sample: logits ", spec.str(), " are Partial. Redistribute them first.");
    if (!p.is_shard()) continue;
    TORCH_CHECK(p.dim == last || p.dim == -1, "sample: logits ", spec.str(), " are sharded on dim ", p.dim,
                ", expected the vocabulary (last) dim or replicated.");
    TORCH_CHECK(!s.group.valid(), "sample: logits ", spec.str(), " are sharded over two mesh dims. NYI.");
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
  const Shard s = shardOf(logits);
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

}  // namespace dtp::inference
