// A Llama-style decoder written with dtp::nn fields, so that
// apply_tensor_parallel can parallelize it the way torchtitan does:
// token embedding, RMSNorm, rotary embeddings, grouped-query attention with a
// causal mask, SwiGLU MLP, final norm, output head (optionally tied).
// Parallelizing it (apply_tensor_parallel, apply_ac, apply_fsdp, apply_ddp,
// apply_expert_parallel, parallelize_llama): dtp/models/parallelize.h.
#pragma once

#include "dtp/cp/context_parallel.h"
#include "dtp/models/moe.h"
#include "dtp/nn/modules.h"
#include "dtp/process_group.h"

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/modules/container/modulelist.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dtp::dcp {
struct StateDictOptions;  // dtp/dcp/state_dict.h
}  // namespace dtp::dcp

namespace dtp::inference {
class KVCache;  // dtp/inference/kv_cache.h
}  // namespace dtp::inference

namespace dtp::models {

using inference::KVCache;

// Llama 3.1's rotary frequencies (Hugging Face's rope_type "llama3"):
// wavelengths longer than original_max_position_embeddings / low_freq_factor
// are stretched by `factor`, shorter than .../ high_freq_factor kept, and the
// band between interpolated. factor 0: plain rotary embeddings.
struct RopeScaling {
  double factor = 0.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// NOTE: [Model families] One decoder carries Llama 2/3, Mistral, Qwen 2.5
// and Qwen 3: they differ only in the switches below (Hugging Face's
// model_type -> switches in llama_config_from_hf):
//   llama    rope_scaling (3.1+), head_dim, tie_embeddings (3.2 1B/3B),
//            attention_bias -> qkv_bias and o_bias
//   mistral  llama + sliding_window
//   qwen2    qkv_bias (not o), tie_embeddings in the small sizes
//   qwen3    qk_norm, head_dim apart from dim / n_heads
//   mixtral  mistral + moe (num_experts, top_k; norm_topk_prob always)
//   qwen2_moe qwen2 (qkv_bias as configured) + moe + a gated shared expert
//            (moe.shared_hidden)
//   qwen3_moe qwen3 + moe (norm_topk_prob as configured)
struct LlamaConfig {
  int64_t vocab_size = 256;  // byte-level tokens
  int64_t dim = 128;
  int64_t n_layers = 2;
  int64_t n_heads = 4;
  int64_t n_kv_heads = 2;
  int64_t ffn_hidden = 0;  // 0: the SwiGLU default, 2/3 of 4*dim rounded up to 32
  int64_t max_seq_len = 256;
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  double dropout = 0.0;  // after attention and MLP, before the residual add
  bool tie_embeddings = false;
  // See NOTE: [Model families].
  std::string family = "llama";  // Hugging Face's model_type, written back by save_hf
  int64_t explicit_head_dim = 0;  // 0: dim / n_heads
  bool qkv_bias = false;          // the q, k and v projections have biases
  bool o_bias = false;            // the output projection has one
  bool qk_norm = false;           // RMSNorm over head_dim on each q and k head, before rotary
  int64_t sliding_window = 0;     // > 0: a query attends to the last sliding_window positions (itself included)
  RopeScaling rope_scaling;
  MoEConfig moe;                  // num_experts > 0: every block's MLP is a mixture of experts
  // A pipeline stage holds some layers only: no embedding, no head.
  bool with_embedding = true;
  bool with_head = true;
  uint64_t seed = 0;  // deterministic init
  // Parameters, buffers and activations. float64 is how "equal to one
  // device" is checked exactly (docs/architecture.md, "Exactness"); the same
  // float32 draws initialize every dtype, so runs of two dtypes start alike.
  c10::ScalarType dtype = c10::ScalarType::Float;
  // Where parameters and buffers live: the CPU, or a GPU (e.g. the mesh's
  // device(), cuda:LOCAL_RANK). Init draws on the CPU generator, so every
  // device starts from the same weights.
  c10::Device device = c10::kCPU;
  // Deferred initialization (NOTE: [Deferred initialization] in
  // src/models/llama.cpp): parameters
  // start on the meta device (no memory); parallelizing gives each rank its
  // uninitialized shards; init_weights(model) then fills them with exactly
  // the values of a one-device init. Forward before init_weights is an error.
  bool deferred_init = false;

  int64_t head_dim() const { return explicit_head_dim > 0 ? explicit_head_dim : dim / n_heads; }
  int64_t hidden() const;
  // Checks sizes; errors name the value and the fix.
  void validate() const;
};

// The attention core on plain per-head tensors: rotary embeddings, the
// grouped-query repeat, causal softmax. q [batch, seq, heads, head_dim], k
// and v [batch, seq, kv_heads, head_dim] -> [batch, seq, heads * head_dim].
// window > 0: the query at position p sees keys p - window + 1 .. p only
// (Mistral's sliding window).
at::Tensor causal_attention(at::Tensor q, at::Tensor k, at::Tensor v, const at::Tensor& rope_cos,
                            const at::Tensor& rope_sin, int64_t window = 0);

// The same on new tokens against `cache` (NOTE: [KV cache positions]): q, k,
// v [batch, seq, heads or kv_heads, head_dim] of this call; k and v are
// written into the cache at each sequence's positions first.
at::Tensor cached_attention(at::Tensor q, at::Tensor k, at::Tensor v, const at::Tensor& rope_cos,
                            const at::Tensor& rope_sin, KVCache& cache, int64_t layer, int64_t window = 0);

// The rotary inverse frequencies of `c` (head_dim / 2 of them, float64),
// with c.rope_scaling applied.
at::Tensor rope_inv_freq(const LlamaConfig& c);

// Rotary embedding of x [batch, seq, heads, head_dim] by tables cos, sin
// broadcastable to [batch, seq, 1, head_dim / 2]: pairs (2i, 2i+1) rotate.
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// A model's context parallelism, shared by the model and its attention
// layers (apply_context_parallel in dtp/models/parallelize.h): the sequence
// is sharded over `group` by `layout`, and each attention runs ring or
// all-to-all attention over it. See NOTE: [Context parallelism in the Llama]
// in src/models/llama_cp.cpp.
struct ContextParallelState {
  ProcessGroup group;
  CpLayout layout = CpLayout::HeadTail;
  bool all_to_all = false;  // all_to_all_attention (Ulysses) instead of ring_attention
  bool shard_kv_cache = false;  // ContextParallelOptions::kv_cache == Sharded (engine_model)
  // The global sequence length of the batch being trained on: set by
  // context_parallel_shard_batch; 0 means cp * S_local (the even case).
  int64_t seq_len = 0;
};

class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const LlamaConfig& c);
  // x: [batch, seq, dim] -> [batch, seq, dim]
  at::Tensor forward(const at::Tensor& x);

  dtp::nn::Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr};
  // LlamaConfig::qk_norm: over head_dim, on this rank's heads under TP.
  dtp::nn::RMSNorm q_norm{nullptr}, k_norm{nullptr};
  at::Tensor rope_cos, rope_sin;  // [max_seq_len, head_dim / 2]
  int64_t head_dim;
  int64_t sliding_window;
  int64_t layer_index = 0;  // its slot in a KVCache
  // >= 0: wk and wv are replicated and this rank attends with this KV head
  // only (TensorParallelOptions::replicate_kv_heads).
  int64_t kv_head = -1;
  // Set: x holds this cp rank's positions of the sequence (apply_context_parallel).
  std::shared_ptr<ContextParallelState> context_parallel;
};
DTP_MODULE(Attention);

// SwiGLU: w2(silu(w1 x) * w3 x); w1 is the gate, w3 the up and w2 the down
// projection (torchtitan's names).
class FeedForwardImpl : public torch::nn::Module {
 public:
  explicit FeedForwardImpl(const LlamaConfig& c);
  at::Tensor forward(const at::Tensor& x);
  dtp::nn::Linear w1{nullptr}, w2{nullptr}, w3{nullptr};
};
DTP_MODULE(FeedForward);

class TransformerBlockImpl : public torch::nn::Module {
 public:
  explicit TransformerBlockImpl(const LlamaConfig& c);
  at::Tensor forward(const at::Tensor& x);
  dtp::nn::RMSNorm attention_norm{nullptr}, ffn_norm{nullptr};
  Attention attention{nullptr};
  FeedForward feed_forward{nullptr};  // or, with LlamaConfig::moe:
  MoE moe{nullptr};
  dtp::nn::Dropout dropout{nullptr};
};
DTP_MODULE(TransformerBlock);

class LlamaImpl : public torch::nn::Module {
 public:
  explicit LlamaImpl(LlamaConfig c);
  // tokens [batch, seq] (i64) -> logits [batch, seq, vocab]; a stage maps
  // activations [batch, seq, dim] to activations.
  at::Tensor forward(const at::Tensor& input);
  // Inference with a KV cache (NOTE: [KV cache positions]): tokens [B, S]
  // (right-padded), valid[b] of them real; returns the logits of each
  // sequence's last valid token, [B, 1, vocab] (vocab-sharded under TP).
  at::Tensor forward(const at::Tensor& tokens, KVCache& cache, const std::vector<int64_t>& valid);
  // Parameters without the tied duplicate, in a fixed order (for optimizers
  // and checkpoints).
  std::vector<std::pair<std::string, at::Tensor>> unique_named_parameters() const;
  std::vector<at::Tensor> unique_parameters() const;

  LlamaConfig config;
  bool awaiting_init = false;  // deferred_init until init_weights
  // Set by apply_context_parallel (the same state as every attention layer's).
  std::shared_ptr<ContextParallelState> context_parallel;
  dtp::nn::Embedding tok_embeddings{nullptr};
  torch::nn::ModuleList layers{nullptr};
  dtp::nn::RMSNorm norm{nullptr};
  dtp::nn::Linear output{nullptr};
};
DTP_MODULE(Llama);

// Initializes a model built with deferred_init, after apply_tensor_parallel,
// apply_ac and apply_fsdp/apply_ddp (or as is, on one device): every
// parameter gets the values a one-device init gives for the same seed. Each
// full parameter is drawn in turn and only this rank's shard kept, so the
// start-up peak is the shards plus one full parameter.
// With `only` (a pipeline rank's parameters, LlamaPipeline::parameters()),
// just those are allocated and set, to the same values; every other
// parameter stays on the meta device, holding no memory.
void init_weights(Llama& model, const std::vector<at::Tensor>& only = {});

// What the Llama's checkpoints hold: parameters, not the rope tables (rebuilt
// from the config, like torchtitan's non-persistent freqs_cis).
dcp::StateDictOptions llama_state_dict_options();

// Mean cross-entropy of logits [batch, seq, vocab] against targets
// [batch, seq]; vocab-sharded DTensor logits go through loss_parallel.
// float16 and bf16 logits are taken in float32 (a float32 loss).
at::Tensor llama_loss(const at::Tensor& logits, const at::Tensor& targets);

// The training loss of `model`'s logits on this rank's tokens: llama_loss,
// and under context parallelism that times S_local * cp / S (this rank's
// share of the sequence's positions), so that the mean over the cp ranks,
// which data parallelism over dp_shard_cp takes of the gradients, is the
// mean over every token of the sequence, even when the ranks hold unequal
// lengths (NOTE: [Context-parallel loss] in src/models/llama_cp.cpp). Each
// rank's value is its weighted share; their mean over the cp group is the
// loss of the whole sequence.
at::Tensor llama_loss(const Llama& model, const at::Tensor& logits, const at::Tensor& targets);

// The data loader's side of context parallelism: this rank's positions of
// each tensor of `batch` (tokens and labels, [B, S, ...], along `seq_dim`)
// under `model`'s layout, and S recorded as the attention's global length.
// No communication; without context parallelism the batch unchanged. Errors
// when the tensors disagree on S, when S > max_seq_len, or when the
// HeadTail layout has fewer than 2 * cp positions to cut.
std::vector<at::Tensor> context_parallel_shard_batch(const Llama& model, const std::vector<at::Tensor>& batch,
                                                     int64_t seq_dim = 1);

// The load-balancing loss of the last forward (Switch / Mixtral form, HF's
// load_balancing_loss_func over all MoE layers at once):
//   num_experts * sum_e (fraction of routed slots to e) * (mean router probability of e),
// times LlamaConfig::moe.aux_loss_coef. Add it to the training loss. A
// model without MoE layers gives 0.
// With `data_parallel` (each rank its batch slice, gradients averaged over
// the group by FSDP/DDP; under expert parallelism the group spans dp x ep:
// data_parallel_group(mesh)): the fractions and means run over every rank's
// tokens (one all_reduce of the counts and token numbers) and each rank
// returns dp times its tokens' share, so that the averaged gradient and the
// averaged value are one device's on the whole batch. Under context
// parallelism the counts are summed over the model's cp group too (one more
// all_reduce) and each rank returns dp x cp times its positions' share: pass
// the rows' group (data_parallel_group(mesh), which never spans cp).
at::Tensor moe_load_balancing_loss(Llama& model, const std::optional<ProcessGroup>& data_parallel = std::nullopt);

}  // namespace dtp::models

// NOTE: [Deprecated forwarding] A public header that loses declarations or
// includes keeps forwarding them for one release, as CHANGELOG.md's
// deprecation policy says. Programs written against the release landed at
// 10df3d0 found apply_tensor_parallel, TensorParallelOptions, llama_tp_plan,
// get_tp_mesh, apply_ac, ACOptions, apply_fsdp, apply_ddp and
// apply_expert_parallel in this header, and KVCache, DeviceMesh,
// dcp::StateDictOptions, fully_shard, replicate, checkpoint and
// parallelize_module through it. They live in dtp/models/parallelize.h and
// dtp/inference/kv_cache.h now; until the next release this header still
// includes both, after its own declarations (parallelize.h includes this
// header, whose #pragma once ends the loop). With GCC, a translation unit
// that reaches this header before dtp/models/parallelize.h gets a note (a
// #pragma message: never a warning, so -Werror builds pass; Clang turns
// #pragma message into a warning, so it gets none). Define
// DTP_NO_DEPRECATED to drop the forwarding and the note, as the next release
// will: dtp's own targets build that way (CMakeLists.txt).
#ifndef DTP_NO_DEPRECATED
#if defined(__GNUC__) && !defined(__clang__) && !defined(DTP_MODELS_PARALLELIZE_H)
#pragma message(                                                                          \
    "dtp/models/llama.h: apply_tensor_parallel, TensorParallelOptions, apply_ac, apply_fsdp, "   \
    "apply_ddp and the other parallelizations moved to dtp/models/parallelize.h, and KVCache "   \
    "to dtp/inference/kv_cache.h; llama.h includes both until the next release. Include what "      \
    "you use, then define DTP_NO_DEPRECATED to build as the next release will (CHANGELOG.md)")
#endif
#include "dtp/inference/kv_cache.h"
#include "dtp/models/parallelize.h"
#endif  // DTP_NO_DEPRECATED
