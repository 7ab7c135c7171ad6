// The reference Llama with a KV cache: prefill and decode
// (NOTE: [KV cache positions] in include/dtp/inference/kv_cache.h).
#include "dtp/dtensor.h"
#include "dtp/inference/kv_cache.h"
#include "dtp/models/llama.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace dtp::models {

namespace {

// softmax(q K^T / sqrt(hd)) V for q [B, S, H, hd] at positions pos [B, S]
// over keys K, V [B, keys, kv_heads, hd] (GQA: each KV head serves
// H / kv_heads query heads). Key j is visible to the query at position p iff
// j <= p (and, with a window, p - j < window). Returns [B, S, H * hd].
// NOTE: [Grouped attention without expansion]: query head h reads KV head
// h / n_rep (n_rep = H / kv_heads). Rather than copying the cache's K and V
// to all H heads every step (at Llama-3.2-1B's shape 136 MB a decode step
// at 520 positions), the n_rep query heads of a group and their S positions
// become the rows of one product against their KV head: q [B, kv, n_rep *
// S, hd] by K [B, kv, keys, hd]. Each score and each output row is the same
// dot product as with the expanded cache.
at::Tensor attend(at::Tensor q, at::Tensor K, at::Tensor V, const at::Tensor& pos, int64_t window) {
  const int64_t batch = q.size(0), seq = q.size(1), head_dim = q.size(3), keys = K.size(1);
  const int64_t kv = K.size(2), n_rep = q.size(2) / kv;
  // [B, S, kv * n_rep, hd] -> [B, kv, n_rep * S, hd]: row r * S + s of group g is head g * n_rep + r at s.
  q = q.reshape({batch, seq, kv, n_rep, head_dim}).permute({0, 2, 3, 1, 4}).reshape({batch, kv, n_rep * seq, head_dim});
  K = K.transpose(1, 2);  // [B, kv, keys, hd]
  V = V.transpose(1, 2);
  at::Tensor scores = (at::matmul(q, K.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim)))
                          .view({batch, kv, n_rep, seq, keys});
  const at::Tensor key = at::arange(keys, pos.options()).view({1, 1, 1, 1, keys});
  const at::Tensor query = pos.view({batch, 1, 1, seq, 1});
  at::Tensor hidden = key > query;
  if (window > 0) hidden = hidden.logical_or(key <= query - window);
  scores = scores.masked_fill(hidden, -std::numeric_limits<float>::infinity());
  const at::Tensor out = at::matmul(at::softmax(scores, -1).view({batch, kv, n_rep * seq, keys}), V);
  // [B, kv, n_rep * S, hd] -> [B, S, kv * n_rep * hd]
  return out.view({batch, kv, n_rep, seq, head_dim}).permute({0, 3, 1, 2, 4}).reshape({batch, seq, -1});
}

// See NOTE: [Packed batch]: q, k, v [1, T, heads, hd] (rotary applied).
at::Tensor packedAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& kc, at::Tensor& vc,
                           const KVCache::Step& step, int64_t window) {
  const int64_t total = q.size(1), head_dim = q.size(3);
  const auto dev = q.device();
  kc.index_copy_(0, step.write_slots.to(dev), k[0]);
  vc.index_copy_(0, step.write_slots.to(dev), v[0]);
  at::Tensor out = at::empty({total, q.size(2) * head_dim}, q.options());
  for (const KVCache::Step::Group& g : step.groups) {
    const int64_t rows = g.gather.size(0), width = g.gather.size(1);
    const at::Tensor qg = q[0].index_select(0, g.gather.to(dev).flatten()).view({rows, width, q.size(2), head_dim});
    const at::Tensor read = g.read.to(dev).flatten();
    const at::Tensor K = kc.index_select(0, read).view({rows, g.keys, kc.size(1), head_dim});
    const at::Tensor V = vc.index_select(0, read).view({rows, g.keys, vc.size(1), head_dim});
    const at::Tensor o = attend(qg, K, V, g.positions.to(dev), window).reshape({rows * width, -1});
    out.index_copy_(0, g.dest.to(dev), o.index_select(0, g.valid.to(dev)));
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
  if (cache.packed()) return packedAttention(q, k, v, kc, vc, step, window);
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
