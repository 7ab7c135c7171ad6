// Context parallelism in the reference Llama: apply_context_parallel, the
// attention over the cp group, the loss and the data loader's batch.
#include "models/llama_cp.h"

#include "dtp/cp/context_parallel.h"
#include "dtp/models/parallelize.h"

#include <ATen/ATen.h>

namespace dtp::models {

// NOTE: [Context parallelism in the Llama]
// Each cp rank holds its positions of every sequence of the batch, in the
// layout's order (HeadTail by default: S = 16 over cp 2, rank 0 holds
// positions 0-3 and 12-15, rank 1 4-11), and the whole model. Everything
// but attention works token by token, so it runs on the local positions as
// it would on the whole sequence; attention is the only place tokens meet:
//   - rotary: each local token is rotated by its global position
//     (context_parallel_position_ids indexes the rope tables);
//   - attention: ring_attention (default) or all_to_all_attention over the
//     cp group, causal on the global positions, exact against one device;
//     q, k and v are this rank's heads under TP (heads by tp, sequence by cp);
//   - the loss: NOTE: [Context-parallel loss];
//   - the gradients: each cp rank's are its positions' part of the sum; FSDP
//     or DDP over dp_shard x cp completes them (NOTE: [Data parallelism over
//     cp] in src/fsdp/data_parallel.cpp).
// Per attention layer and step, ring attention sends cp - 1 key/value chunks
// forward and 2*cp - 1 messages backward; all-to-all attention 4
// all_to_alls each way. The global length S comes from the batch
// (context_parallel_shard_batch records it), so an S that 2*cp does not
// divide works: ranks then hold lengths differing by one.

// NOTE: [Context-parallel loss]
// The loss of one device is the mean over the B*S tokens of the batch. A cp
// rank holding S_r positions computes the mean over its B*S_r; data
// parallelism averages the gradients over dp_shard x cp, i.e. takes
// (1/cp) sum_r of each rank's loss per dp rank. With each rank's loss
// weighted by S_r * cp / S, that average is (1/cp) sum_r (S_r cp / S)
// sum_r(tokens) / (B S_r) = sum(tokens) / (B S): the mean over every token,
// whatever the lengths. Weighting by ranks instead (each rank's plain mean)
// is off by S_r * cp / S, which is 1 only when S divides by the layout.

namespace {

// The global length the attention assumes: the batch's, or the even case.
int64_t globalLen(const ContextParallelState& cp, int64_t local) {
  return cp.seq_len > 0 ? cp.seq_len : cp.group.size() * local;
}

}  // namespace

void apply_context_parallel(Llama& model, const DeviceMesh& cp_mesh, ContextParallelOptions options) {
  constexpr const char* api = "apply_context_parallel";
  TORCH_CHECK(cp_mesh.valid() && cp_mesh.ndim() == 1, api, ": got ", cp_mesh.valid() ? cp_mesh.str() : "an invalid mesh",
              ", expected a 1-D mesh over the cp ranks. Pass mesh[\"cp\"].");
  TORCH_CHECK(!model->context_parallel, api, ": the model has context parallelism already. Apply it once.");
  const int64_t cp = cp_mesh.size(0);
  TORCH_CHECK(options.attention != ContextParallelAttention::AllToAll || model->config.n_heads % cp == 0, api,
              ": all-to-all attention over cp ", cp, " with n_heads=", model->config.n_heads, ": got a head count "
              "that does not divide by cp, expected a multiple of ", cp, ". Use ContextParallelAttention::Ring.");
  TORCH_CHECK(options.seq_len >= 0, api, ": seq_len=", options.seq_len, ", expected 0 (the even case) or the length.");
  TORCH_CHECK(options.layout != CpLayout::HeadTail || options.seq_len == 0 || options.seq_len >= 2 * cp, api,
              ": seq_len=", options.seq_len, " over cp ", cp, ": the HeadTail layout cuts the sequence into 2 * cp = ",
              2 * cp, " chunks, expected at least that many positions. Use a longer sequence, a smaller cp, or "
              "CpLayout::Contiguous.");
  auto state = std::make_shared<ContextParallelState>();
  state->group = cp_mesh.get_group(0);
  state->layout = options.layout;
  state->all_to_all = options.attention == ContextParallelAttention::AllToAll;
  state->shard_kv_cache = options.kv_cache == CpKvCache::Sharded;
  state->seq_len = options.seq_len;
  model->context_parallel = state;
  for (const auto& layer : *model->layers)
    layer->as<dtp::nn::HookedImpl<TransformerBlockImpl>>()->attention->context_parallel = state;
}

namespace detail {

// NOTE: [Context parallelism in a pipeline]
// pipeline_llama on a (pp, cp[, dp][, tp]) mesh parallelizes each stage of
// this rank over the mesh without pp, so every stage's attention layers run
// over the cp group of this rank's pp coordinate; the stages of one pp rank
// and the whole model then share one ContextParallelState:
//   - the batch: context_parallel_shard_batch(model, {tokens, labels}) on the
//     whole model cuts every sequence to this cp rank's positions and
//     records S once for every stage; the pipeline then splits those rows
//     into microbatches along dim 0, so each microbatch holds the same
//     positions of its rows (sharding before or after the split is the
//     same cut);
//   - between stages the activations [B/m, S_local, dim] go to the same cp
//     (and tp) rank of the next stage: a stage's positions never change;
//   - the loss: the last stage's loss_fn is llama_loss(model, ...), each
//     microbatch's mean weighted by S_local * cp / S (NOTE: [Context-parallel
//     loss]); the pipeline's mean over microbatches keeps that weight, and
//     FSDP or DDP over dp_shard x cp inside every stage averages it;
//   - the messages: every cp rank of a stage runs the same schedule, so the
//     ring's send/recv pairs (on the cp group) meet in the same order; per
//     microbatch and layer they are the closed form of NOTE: [Context
//     parallelism in the Llama].
std::shared_ptr<ContextParallelState> share_context_parallel(Llama whole, const std::vector<Llama>& stages) {
  TORCH_INTERNAL_ASSERT(!stages.empty() && stages[0]->context_parallel, "share_context_parallel: no stage with context "
                        "parallelism");
  std::shared_ptr<ContextParallelState> state = stages[0]->context_parallel;
  whole->context_parallel = state;
  for (Llama stage : stages) {
    stage->context_parallel = state;
    for (const auto& layer : *stage->layers)
      layer->as<dtp::nn::HookedImpl<TransformerBlockImpl>>()->attention->context_parallel = state;
  }
  return state;
}

at::Tensor context_parallel_attention(const AttentionImpl& a, at::Tensor q, at::Tensor k, at::Tensor v) {
  const ContextParallelState& cp = *a.context_parallel;
  const int64_t batch = q.size(0), local = q.size(1), seq = globalLen(cp, local);
  TORCH_CHECK(seq <= a.rope_cos.size(0), "Attention: sequence length ", seq, " exceeds max_seq_len=",
              a.rope_cos.size(0), ". Raise LlamaConfig::max_seq_len.");
  const at::Tensor pos = context_parallel_position_ids(seq, cp.group, cp.layout, q.device());
  TORCH_CHECK(pos.size(0) == local, "Attention: this cp rank's input holds ", local, " positions, but the ",
              to_string(cp.layout), " layout of a sequence of ", seq, " over cp ", cp.group.size(), " gives it ",
              pos.size(0), ". Shard the batch with context_parallel_shard_batch(model, {tokens, labels}).");
  const at::Tensor c = a.rope_cos.index_select(0, pos).view({1, local, 1, -1});
  const at::Tensor s = a.rope_sin.index_select(0, pos).view({1, local, 1, -1});
  q = apply_rope(q, c, s).transpose(1, 2);  // [B, H, S_local, D]
  k = apply_rope(k, c, s);
  if (KvCapture* kv = KvCapture::active()) kv->record(a.layer_index, k, v);  // NOTE: [Context-parallel prefill]
  k = k.transpose(1, 2);
  v = v.transpose(1, 2);
  // Mistral's sliding window: blocks wholly outside it are skipped, the
  // edge masked (NOTE: [Ring attention]); one at least as long as the
  // sequence hides nothing.
  const int64_t window = a.sliding_window > 0 && a.sliding_window < seq ? a.sliding_window : 0;
  const auto options = CpAttentionOptions().causal(true).layout(cp.layout).seq_len(seq).window(window);
  const at::Tensor out =
      cp.all_to_all ? all_to_all_attention(q, k, v, cp.group, options) : ring_attention(q, k, v, cp.group, options);
  return out.transpose(1, 2).reshape({batch, local, -1});
}

}  // namespace detail

at::Tensor llama_loss(const Llama& model, const at::Tensor& logits, const at::Tensor& targets) {
  at::Tensor loss = llama_loss(logits, targets);
  if (!model->context_parallel) return loss;
  // See NOTE: [Context-parallel loss].
  const ContextParallelState& cp = *model->context_parallel;
  const int64_t local = targets.size(1), seq = globalLen(cp, local), n = cp.group.size();
  if (local * n == seq) return loss;  // the even case: weight 1
  return loss * (static_cast<double>(local * n) / static_cast<double>(seq));
}

std::vector<at::Tensor> context_parallel_shard_batch(const Llama& model, const std::vector<at::Tensor>& batch,
                                                     int64_t seq_dim) {
  constexpr const char* api = "context_parallel_shard_batch";
  if (!model->context_parallel) return batch;
  ContextParallelState& cp = *model->context_parallel;
  TORCH_CHECK(!batch.empty(), api, ": got no tensors, expected the batch's (tokens, labels).");
  const int64_t dim = c10::maybe_wrap_dim(seq_dim, batch[0].dim());
  const int64_t seq = batch[0].size(dim), n = cp.group.size();
  for (size_t i = 1; i < batch.size(); ++i)
    TORCH_CHECK(batch[i].dim() > dim && batch[i].size(dim) == seq, api, ": tensor ", i, " has ",
                batch[i].dim() > dim ? batch[i].size(dim) : 0, " positions along dim ", dim, ", expected ", seq,
                " as tensor 0. Pass tensors of the same sequences (tokens and their labels).");
  TORCH_CHECK(seq <= model->config.max_seq_len, api, ": a sequence of ", seq, " positions, expected at most "
              "max_seq_len=", model->config.max_seq_len, ". Raise LlamaConfig::max_seq_len or shorten the sequence.");
  TORCH_CHECK(cp.layout != CpLayout::HeadTail || seq >= 2 * n, api, ": a sequence of ", seq, " positions over cp ",
              n, ": the HeadTail layout cuts it into 2 * cp = ", 2 * n, " chunks, expected at least ", 2 * n,
              " positions. Train on longer sequences or a smaller cp.");
  cp.seq_len = seq;
  std::vector<at::Tensor> out;
  for (const auto& x : batch) out.push_back(context_parallel_shard(x, dim, cp.group, cp.layout));
  return out;
}

}  // namespace dtp::models
