// The reference Llama with a KV cache: prefill and decode
// (NOTE: [KV cache positions] in include/dtp/inference/kv_cache.h).
#include "dtp/dtensor.h"
#include "dtp/inference/kv_cache.h"
#include "dtp/models/llama.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace dtp::models {

namespace {

// NOTE: [Grouped attention without expansion]: query head h reads KV head
// h / n_rep (n_rep = H / kv_heads). Rather than copying the cache's K and V
// to all H heads every step (at Llama-3.2-1B's shape 136 MB a decode step
// at 520 positions), the n_rep query heads of a group and their S positions
// become the rows of one product against their KV head: q [B, kv, n_rep *
// S, hd] by K [B, kv, keys, hd]. Each score and each output row is the same
// dot product as with the expanded cache.

// q [B, S, kv * n_rep, hd] as the rows of its KV heads: [B, kv, n_rep * S, hd].
at::Tensor groupedQueries(const at::Tensor& q, int64_t kv) {
  const int64_t batch = q.size(0), seq = q.size(1), head_dim = q.size(3), n_rep = q.size(2) / kv;
  return q.reshape({batch, seq, kv, n_rep, head_dim}).permute({0, 2, 3, 1, 4}).reshape({batch, kv, n_rep * seq, head_dim});
}

// Back: [B, kv, n_rep * S, hd] -> [B, S, kv * n_rep * hd].
at::Tensor ungroupedOutput(const at::Tensor& out, int64_t seq) {
  const int64_t batch = out.size(0), kv = out.size(1), head_dim = out.size(3), n_rep = out.size(2) / seq;
  return out.reshape({batch, kv, n_rep, seq, head_dim}).permute({0, 3, 1, 2, 4}).reshape({batch, seq, -1});
}

// The scores of the grouped queries qg [B, kv, n_rep * S, hd] against K [B,
// keys, kv, hd], masked: [B, kv, n_rep, S, keys]. `held` ([B, keys] bool,
// or undefined) hides the keys another rank holds (NOTE: [KV cache sharded
// over cp]).
at::Tensor maskedScores(const at::Tensor& qg, const at::Tensor& K, const at::Tensor& pos, int64_t window,
                        const at::Tensor& held) {
  const int64_t batch = qg.size(0), kv = qg.size(1), head_dim = qg.size(3), keys = K.size(1), seq = pos.size(1);
  at::Tensor scores = (at::matmul(qg, K.transpose(1, 2).transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim)))
                          .view({batch, kv, -1, seq, keys});
  const at::Tensor key = at::arange(keys, pos.options()).view({1, 1, 1, 1, keys});
  const at::Tensor query = pos.view({batch, 1, 1, seq, 1});
  at::Tensor hidden = key > query;
  if (window > 0) hidden = hidden.logical_or(key <= query - window);
  if (held.defined()) hidden = hidden.logical_or(held.logical_not().view({batch, 1, 1, 1, keys}));
  return scores.masked_fill(hidden, -std::numeric_limits<float>::infinity());
}

// softmax(q K^T / sqrt(hd)) V for q [B, S, H, hd] at positions pos [B, S]
// over keys K, V [B, keys, kv_heads, hd] (GQA: each KV head serves
// H / kv_heads query heads). Key j is visible to the query at position p iff
// j <= p (and, with a window, p - j < window). Returns [B, S, H * hd].
at::Tensor attend(const at::Tensor& q, const at::Tensor& K, const at::Tensor& V, const at::Tensor& pos, int64_t window) {
  const int64_t batch = q.size(0), seq = q.size(1), kv = K.size(2), keys = K.size(1);
  const at::Tensor scores = maskedScores(groupedQueries(q, kv), K, pos, window, at::Tensor());
  const at::Tensor out = at::matmul(at::softmax(scores, -1).view({batch, kv, -1, keys}), V.transpose(1, 2));
  return ungroupedOutput(out, seq);
}

// This rank's part of attend() over the keys it holds (NOTE: [KV cache
// sharded over cp] in include/dtp/inference/kv_cache.h): [B, kv, n_rep * S,
// hd + 1], each grouped query row's output over those keys, then its
// log-sum-exp (-inf where it sees none). In float64 for float64 inputs,
// else float32 (the matmuls in the input dtype, as ring attention).
at::Tensor attendHeld(const at::Tensor& q, const at::Tensor& K, const at::Tensor& V, const at::Tensor& pos, int64_t window,
                      const at::Tensor& held) {
  const int64_t batch = q.size(0), kv = K.size(2), keys = K.size(1);
  const at::ScalarType acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor scores = maskedScores(groupedQueries(q, kv), K, pos, window, held).to(acc);
  const at::Tensor lse = at::logsumexp(scores, -1, /*keepdim=*/true);
  const at::Tensor shift = lse.masked_fill(lse.isinf(), 0);  // a row that sees nothing: weights exp(-inf) = 0
  const at::Tensor weights = at::exp(scores - shift).to(V.scalar_type()).view({batch, kv, -1, keys});
  const at::Tensor out = at::matmul(weights, V.transpose(1, 2)).to(acc);
  return at::cat({out, lse.view({batch, kv, -1, 1})}, -1);
}

// Every rank's partials of the same rows ([..., hd + 1] each) merged by
// their log-sum-exp: [..., hd]. One all_gather over `group`.
at::Tensor mergeHeld(const at::Tensor& part, const ProcessGroup& group) {
  const int64_t n = group.size(), head_dim = part.size(-1) - 1;
  const at::Tensor all = group.all_gather(part.unsqueeze(0), 0, std::vector<int64_t>(n, 1)).wait();
  const at::Tensor lse = all.narrow(-1, head_dim, 1);
  return (all.narrow(-1, 0, head_dim) * at::exp(lse - at::logsumexp(lse, 0, /*keepdim=*/true))).sum(0);
}

// See NOTE: [Packed batch]: q, k, v [1, T, heads, hd] (rotary applied).
at::Tensor packedAttention(const at::Tensor& q, at::Tensor k, at::Tensor v, at::Tensor& kc, at::Tensor& vc,
                           const KVCache& cache, int64_t window) {
  const KVCache::Step& step = cache.step();
  const int64_t total = q.size(1), head_dim = q.size(3);
  const auto dev = q.device();
  k = k[0];
  v = v[0];
  if (step.write_rows.defined()) {  // sharded: the tokens whose block this rank holds
    k = k.index_select(0, step.write_rows.to(dev));
    v = v.index_select(0, step.write_rows.to(dev));
  }
  kc.index_copy_(0, step.write_slots.to(dev), k);
  vc.index_copy_(0, step.write_slots.to(dev), v);
  std::vector<at::Tensor> outs, parts;
  for (const KVCache::Step::Group& g : step.groups) {
    const int64_t rows = g.gather.size(0), width = g.gather.size(1);
    const at::Tensor qg = q[0].index_select(0, g.gather.to(dev).flatten()).view({rows, width, q.size(2), head_dim});
    const at::Tensor read = g.read.to(dev).flatten();
    const at::Tensor K = kc.index_select(0, read).view({rows, g.keys, kc.size(1), head_dim});
    const at::Tensor V = vc.index_select(0, read).view({rows, g.keys, vc.size(1), head_dim});
    if (cache.is_sharded()) {
      parts.push_back(attendHeld(qg, K, V, g.positions.to(dev), window, g.held.to(dev)));
    } else {
      outs.push_back(attend(qg, K, V, g.positions.to(dev), window));
    }
  }
  if (cache.is_sharded()) {  // one merge of every group's rows
    std::vector<at::Tensor> flat;
    for (const at::Tensor& p : parts) flat.push_back(p.reshape({-1, head_dim + 1}));
    const at::Tensor merged = mergeHeld(at::cat(flat), cache.shard_group()).to(q.scalar_type());
    int64_t at = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      const at::Tensor& p = parts[i];
      const int64_t n = p.numel() / (head_dim + 1);
      const at::Tensor o = merged.narrow(0, at, n).view({p.size(0), p.size(1), p.size(2), head_dim});
      outs.push_back(ungroupedOutput(o, step.groups[i].gather.size(1)));
      at += n;
    }
  }
  at::Tensor out = at::empty({total, q.size(2) * head_dim}, q.options());
  for (size_t i = 0; i < outs.size(); ++i) {
    const KVCache::Step::Group& g = step.groups[i];
    const int64_t rows = g.gather.size(0), width = g.gather.size(1);
    out.index_copy_(0, g.dest.to(dev), outs[i].reshape({rows * width, -1}).index_select(0, g.valid.to(dev)));
  }
  return out.view({1, total, -1});
}

}  // namespace

at::Tensor cached_attention(at::Tensor q, at::Tensor k, at::Tensor v, const at::Tensor& rope_cos,
                            const at::Tensor& rope_sin, KVCache& cache, int64_t layer, int64_t window) {
  const KVCache::Step& step = cache.step();
  const int64_t batch = q.size(0), seq = q.size(1), head_dim = q.size(3), keys = step.keys;
  TORCH_CHECK(keys <= rope_cos.size(0), "Attention: position ", keys - 1, " exceeds max_seq_len=", rope_cos.size(0),
              ". Raise LlamaConfig::max_seq_len, or build the KVCache with max_seq <= ", rope_cos.size(0), ".");
  const at::Tensor pos = step.positions.to(q.device());
  const auto c = rope_cos.index_select(0, pos.flatten()).view({batch, seq, 1, -1});
  const auto s = rope_sin.index_select(0, pos.flatten()).view({batch, seq, 1, -1});
  q = apply_rope(q, c, s);
  k = apply_rope(k, c, s);
  auto [kc, vc] = cache.layer(layer, k);
  if (cache.packed()) return packedAttention(q, k, v, kc, vc, cache, window);
  at::Tensor K, V;
  if (cache.is_paged()) {  // See NOTE: [Paged KV cache].
    const at::Tensor slots = step.write_slots.to(q.device()), read = step.read_slots.to(q.device()).flatten();
    at::Tensor kn = k.reshape({batch * seq, k.size(2), head_dim}), vn = v.reshape({batch * seq, v.size(2), head_dim});
    if (step.write_rows.defined()) {
      const at::Tensor rows = step.write_rows.to(q.device());
      kn = kn.index_select(0, rows);
      vn = vn.index_select(0, rows);
    }
    kc.index_copy_(0, slots, kn);
    vc.index_copy_(0, slots, vn);
    K = kc.index_select(0, read).view({batch, keys, kc.size(1), head_dim});
    V = vc.index_select(0, read).view({batch, keys, vc.size(1), head_dim});
    if (cache.is_sharded()) {  // See NOTE: [KV cache sharded over cp].
      const at::Tensor part = attendHeld(q, K, V, pos, window, step.read_held.to(q.device()));
      const at::Tensor out = mergeHeld(part, cache.shard_group()).to(q.scalar_type());
      return ungroupedOutput(out, seq);
    }
  } else {
    for (int64_t b = 0; b < batch; ++b) {
      kc[b].narrow(0, step.start[b], seq).copy_(k[b]);
      vc[b].narrow(0, step.start[b], seq).copy_(v[b]);
    }
    K = kc.narrow(0, 0, batch).narrow(1, 0, keys);
    V = vc.narrow(0, 0, batch).narrow(1, 0, keys);
  }
  return attend(q, K, V, pos, window);
}

at::Tensor LlamaImpl::forward(const at::Tensor& tokens, KVCache& cache, const std::vector<int64_t>& valid) {
  TORCH_CHECK(config.with_embedding && config.with_head, "Llama: a KV-cache forward needs the embedding and the "
              "head (a pipeline stage is NYI here).");
  TORCH_CHECK(tokens.dim() == 2, "Llama: KV-cache forward takes tokens [batch, seq], got ", tokens.sizes(), ".");
  const int64_t batch = cache.packed() ? static_cast<int64_t>(valid.size()) : tokens.size(0), seq = tokens.size(1);
  if (cache.packed()) {
    int64_t total = 0;
    for (int64_t n : valid) total += n;
    TORCH_CHECK(tokens.size(0) == 1 && seq == total, "Llama: a packed KV-cache forward (NOTE: [Packed batch]) takes "
                "tokens [1, T] with T the sum of valid (", total, "), got ", tokens.sizes(), ".");
  }
  TORCH_CHECK(static_cast<int64_t>(valid.size()) == batch, "Llama: ", valid.size(), " valid lengths for a batch of ",
              batch, ". Give one per sequence.");
  cache.begin(valid, seq);
  at::Tensor h;
  {
    KVCache::Activate active(&cache);
    h = tok_embeddings(tokens);
    for (const auto& layer : *layers) h = dtp::nn::run_hooked(*layer->as<dtp::nn::HookedImpl<TransformerBlockImpl>>(), h);
  }
  // Only each sequence's last valid token goes through the head.
  const bool dt = is_dtensor(h);
  if (dt) {
    for (const auto& p : placements(h)) {
      TORCH_CHECK(p.is_replicate(), "Llama: a KV-cache forward needs replicated activations between blocks, got ",
                  dtensor_spec(h).str(), ". Parallelize with apply_tensor_parallel_for_inference (no sequence "
                  "parallelism).");
    }
  }
  const at::Tensor local = dt ? to_local(h) : h;
  at::Tensor last;  // [B, 1, dim]
  if (cache.packed()) {  // NOTE: [Packed batch]: sequence b's last token ends its run of valid[b]
    std::vector<int64_t> ends;
    int64_t end = 0;
    for (int64_t n : valid) ends.push_back((end += n) - 1);
    last = local[0].index_select(0, at::tensor(ends, at::kLong).to(local.device())).unsqueeze(1);
  } else if (std::all_of(valid.begin(), valid.end(), [&](int64_t n) { return n == valid[0]; })) {
    last = local.narrow(1, valid[0] - 1, 1);  // every decode step, and a prefill of equal lengths
  } else {
    std::vector<at::Tensor> rows;
    for (int64_t b = 0; b < batch; ++b) rows.push_back(local[b].narrow(0, valid[b] - 1, 1));
    last = at::stack(rows);
  }
  if (dt) last = from_local(last, device_mesh(h), placements(h), /*run_check=*/false, std::vector<int64_t>{batch, 1, config.dim});
  at::Tensor logits = output(norm(last));
  cache.end(valid);
  return logits;
}

}  // namespace dtp::models
