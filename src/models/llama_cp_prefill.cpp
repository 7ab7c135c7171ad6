// Generation under context parallelism: the prompt's prefill over the cp
// group, the KV cache gathered on every rank, decode as without cp.
#include "models/llama_cp.h"

#include "dtp/cp/context_parallel.h"
#include "dtp/dtensor.h"
#include "dtp/inference/kv_cache.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace dtp::models::detail {

// NOTE: [Context-parallel prefill]
// generate and the serving engine call the model's KV-cache forward
// (engine_model). On a model with context parallelism that forward runs
// here, in one of two ways:
//   - a prefill from empty caches (every row's cached length 0) of a longest
//     prompt S of at least 2 * cp positions (HeadTail; cp under Contiguous)
//     runs over cp (a sliding window too: the cache keeps every position
//     and masks by the window, as the ring does): the rows,
//     right-padded to S (a packed [1, T] batch unpacked first), are cut to
//     this rank's positions (context_parallel_shard) and go through the
//     blocks as in training, ring or all-to-all attention over cp; each
//     attention layer's rotated keys and values of the local positions are
//     kept (KvCapture) and, after the blocks, gathered over cp one layer at a
//     time (context_parallel_unshard: one all_gather of k and v side by
//     side) and written into this rank's cache at the slots the cache gives
//     the call, as the plain forward would write them (NOTE: [Paged KV
//     cache]). Each row's last valid token's hidden state comes from the rank
//     holding it (one all_reduce of [B, 1, dim], zeros elsewhere: exact), and
//     goes through the final norm and the head on every rank;
//   - anything else (decode steps, a prefill continuing cached tokens, a
//     short prompt) is the plain forward with the attention layers' cp state
//     detached for the call: every cp rank then holds the whole cache and
//     computes the same step, as a replica.
// So the prefill's activations and attention shard over cp (the long part
// of a long prompt), the KV cache does not: each rank holds the whole
// prompt's keys and values, as without cp. Every rank ends the prefill with
// the same cache and the same logits, so they draw the same tokens. With a
// cache sharded over cp (NOTE: [KV cache sharded over cp] in
// include/dtp/inference/kv_cache.h) each rank writes the gathered keys and
// values of the blocks it holds only, and every later call attends over the
// ranks' blocks and merges (one all_gather per layer): the whole prompt's
// keys and values of one layer pass through each rank, never all layers'.
// Messages per prefill, per layer: ring attention's cp - 1 send/recv pairs
// (or all-to-all's 4 all_to_alls) and 1 all_gather; then 1 all_reduce.

namespace {

thread_local KvCapture* tActiveCapture = nullptr;

// Sets every attention layer's cp state to `state` for the scope.
class AttentionStateScope {
 public:
  AttentionStateScope(Llama& model, std::shared_ptr<ContextParallelState> state) {
    for (const auto& layer : *model->layers) {
      AttentionImpl* a = layer->as<dtp::nn::HookedImpl<TransformerBlockImpl>>()->attention.get();
      saved_.emplace_back(a, a->context_parallel);
      a->context_parallel = state;
    }
  }
  ~AttentionStateScope() {
    for (auto& [a, state] : saved_) a->context_parallel = std::move(state);
  }
  AttentionStateScope(const AttentionStateScope&) = delete;
  AttentionStateScope& operator=(const AttentionStateScope&) = delete;

 private:
  std::vector<std::pair<AttentionImpl*, std::shared_ptr<ContextParallelState>>> saved_;
};

// Whether this call prefills over cp (the first case of the NOTE).
bool prefillsOverCp(const Llama& model, const KVCache& cache, int64_t longest) {
  const ContextParallelState& cp = *model->context_parallel;
  const std::vector<int64_t>& cached = cache.lengths();
  if (std::any_of(cached.begin(), cached.end(), [](int64_t n) { return n != 0; })) return false;
  const int64_t n = cp.group.size();
  return longest >= (cp.layout == CpLayout::HeadTail ? 2 * n : n);
}

// Rows [B, S] right-padded from a packed [1, T] call (NOTE: [Packed batch]):
// row b's valid[b] tokens, then its last token repeated.
at::Tensor unpack(const at::Tensor& tokens, const std::vector<int64_t>& valid, int64_t seq) {
  std::vector<at::Tensor> rows;
  int64_t offset = 0;
  for (const int64_t n : valid) {
    const at::Tensor row = tokens[0].narrow(0, offset, n);
    rows.push_back(n == seq ? row : at::cat({row, row.narrow(0, n - 1, 1).expand({seq - n})}));
    offset += n;
  }
  return at::stack(rows);
}

// The rows of [B * S] that hold valid tokens, in order.
at::Tensor validRows(const std::vector<int64_t>& valid, int64_t seq) {
  std::vector<int64_t> rows;
  for (size_t b = 0; b < valid.size(); ++b)
    for (int64_t s = 0; s < valid[b]; ++s) rows.push_back(static_cast<int64_t>(b) * seq + s);
  return at::tensor(rows, at::kLong);
}

// The rows of the padded [B * S] whose keys and values this rank writes, in
// the order of the step's write_slots (paged): the valid tokens, or under a
// sharded cache those of the blocks this rank holds (NOTE: [KV cache sharded
// over cp]). A packed call's write_rows index its [T] tokens, the valid rows
// in order.
at::Tensor writtenRows(const KVCache& cache, const std::vector<int64_t>& valid, int64_t seq) {
  const at::Tensor& rows = cache.step().write_rows;
  if (!cache.packed() && rows.defined()) return rows;
  const at::Tensor all = validRows(valid, seq);
  return rows.defined() ? all.index_select(0, rows) : all;
}

// Writes one layer's keys or values of the whole prompt, [B, S, kv_heads,
// head_dim] in padded rows, where the plain forward would (llama_kv.cpp's
// cached_attention): the valid tokens at the call's slots (paged), or all S
// positions from each row's start (contiguous).
void writeCache(at::Tensor& cache_layer, const at::Tensor& x, const KVCache& cache, const at::Tensor& rows) {
  const KVCache::Step& step = cache.step();
  if (cache.is_paged()) {
    const at::Tensor flat = x.reshape({-1, x.size(2), x.size(3)}).index_select(0, rows.to(x.device()));
    cache_layer.index_copy_(0, step.write_slots.to(x.device()), flat);
    return;
  }
  for (int64_t b = 0; b < x.size(0); ++b) cache_layer[b].narrow(0, step.start[b], x.size(1)).copy_(x[b]);
}

at::Tensor prefillOverCp(Llama& model, const at::Tensor& tokens, KVCache& cache, const std::vector<int64_t>& valid,
                         int64_t longest) {
  ContextParallelState& cp = *model->context_parallel;
  const int64_t batch = static_cast<int64_t>(valid.size());
  const at::Tensor rows = cache.packed() ? unpack(tokens, valid, longest) : tokens;
  const int64_t seq = rows.size(1);
  TORCH_CHECK(seq <= model->config.max_seq_len, "Llama: a prompt of ", seq, " positions, expected at most "
              "max_seq_len=", model->config.max_seq_len, ". Shorten the prompt.");
  cache.begin(valid, tokens.size(1));  // its checks before any message; the slots this call writes
  cp.seq_len = seq;
  KvCapture capture;
  at::Tensor h;
  {
    AttentionStateScope attach(model, model->context_parallel);
    h = model->tok_embeddings(context_parallel_shard(rows, 1, cp.group, cp.layout));
    for (const auto& layer : *model->layers)
      h = dtp::nn::run_hooked(*layer->as<dtp::nn::HookedImpl<TransformerBlockImpl>>(), h);
  }
  // The cache: what a plain prefill of `tokens` would hold.
  const at::Tensor written = cache.is_paged() ? writtenRows(cache, valid, seq) : at::Tensor();
  for (const auto& layer : *model->layers) {
    const int64_t i = layer->as<dtp::nn::HookedImpl<TransformerBlockImpl>>()->attention->layer_index;
    TORCH_INTERNAL_ASSERT(i < static_cast<int64_t>(capture.k.size()) && capture.k[i].defined(),
                          "prefill over cp: layer ", i, " recorded no keys");
    const int64_t kd = capture.k[i].size(3);
    const at::Tensor kv = context_parallel_unshard(at::cat({capture.k[i], capture.v[i]}, -1), 1, seq, cp.group, cp.layout);
    capture.k[i] = capture.v[i] = at::Tensor();  // the local parts are done with
    const at::Tensor k = kv.narrow(-1, 0, kd), v = kv.narrow(-1, kd, kv.size(-1) - kd);
    auto [kc, vc] = cache.layer(i, k);
    writeCache(kc, k, cache, written);
    writeCache(vc, v, cache, written);
  }
  // Each row's last valid token, from the rank holding it.
  const bool dt = is_dtensor(h);
  if (dt) {
    for (const auto& p : placements(h))
      TORCH_CHECK(p.is_replicate(), "Llama: a prefill under context parallelism needs replicated activations between "
                  "blocks, got ", dtensor_spec(h).str(), ". Parallelize with apply_tensor_parallel_for_inference (no "
                  "sequence parallelism).");
  }
  const at::Tensor local = dt ? to_local(h) : h;
  const at::Tensor pos = context_parallel_position_ids(seq, cp.group, cp.layout);
  at::Tensor last = at::zeros({batch, 1, local.size(2)}, local.options());
  const auto p = pos.accessor<int64_t, 1>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < pos.size(0); ++j)
      if (p[j] == valid[b] - 1) last[b].copy_(local[b].narrow(0, j, 1));
  last = cp.group.all_reduce(last).wait();
  if (dt) last = from_local(last, device_mesh(h), placements(h), /*run_check=*/false,
                            std::vector<int64_t>{batch, 1, model->config.dim});
  at::Tensor logits = model->output(model->norm(last));
  cache.end(valid);
  return logits;
}

}  // namespace

KvCapture::KvCapture() : prev_(tActiveCapture) { tActiveCapture = this; }
KvCapture::~KvCapture() { tActiveCapture = prev_; }
KvCapture* KvCapture::active() { return tActiveCapture; }

void KvCapture::record(int64_t layer, const at::Tensor& keys, const at::Tensor& values) {
  if (static_cast<int64_t>(k.size()) <= layer) {
    k.resize(layer + 1);
    v.resize(layer + 1);
  }
  k[layer] = keys;
  v[layer] = values;
}

at::Tensor context_parallel_cached_forward(Llama& model, const at::Tensor& tokens, KVCache& cache,
                                           const std::vector<int64_t>& valid, bool* over_cp) {
  TORCH_INTERNAL_ASSERT(model->context_parallel, "context_parallel_cached_forward: the model has no cp state");
  const int64_t longest = valid.empty() ? 0 : *std::max_element(valid.begin(), valid.end());
  TORCH_CHECK(tokens.dim() == 2, "Llama: KV-cache forward takes tokens [batch, seq], got ", tokens.sizes(), ".");
  TORCH_CHECK(!model->awaiting_init, "Llama: built with deferred_init, and neither init_weights(model) nor "
              "load_hf_weights has set its weights. Set them before generating.");
  TORCH_CHECK(model->config.with_embedding && model->config.with_head, "Llama: a KV-cache forward needs the "
              "embedding and the head (a pipeline stage is NYI here).");
  TORCH_CHECK(cache.packed() || static_cast<int64_t>(valid.size()) == tokens.size(0), "Llama: ", valid.size(),
              " valid lengths for a batch of ", tokens.size(0), ". Give one per sequence.");
  const bool cp = !valid.empty() && prefillsOverCp(model, cache, longest);
  if (over_cp != nullptr) *over_cp = cp;
  if (cp) return prefillOverCp(model, tokens, cache, valid, longest);
  AttentionStateScope detach(model, nullptr);
  return model->forward(tokens, cache, valid);
}

}  // namespace dtp::models::detail
