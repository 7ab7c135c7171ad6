// Hugging Face decoder folders (Llama 1/2/3, Mistral, Qwen 2.5, Qwen 3: see
// NOTE: [Model families] in llama.h) in and out of the reference decoder, at
// any TP / FSDP / DDP layout, without a whole model on any rank.
//
//   LlamaConfig c = models::llama_config_from_hf("Qwen2.5-7B");
//   Llama model(c);
//   apply_tensor_parallel(model, mesh);          // any layout
//   models::load_hf_weights(model, "Qwen2.5-7B");   // each rank reads its shards' bytes
//   ...
//   models::save_hf(model, "out");               // collective: sharded files + index + config.json
//
// A folder is what transformers' save_pretrained writes for
// {Llama,Mistral,Qwen2,Qwen3}ForCausalLM: config.json, and model.safetensors
// or model-0000k-of-0000n.safetensors with model.safetensors.index.json.
// Names map as torchtitan's converter maps them:
//   model.embed_tokens.weight                        tok_embeddings.weight
//   model.layers.N.self_attn.{q,k,v,o}_proj.weight   layers.N.attention.w{q,k,v,o}.weight
//   model.layers.N.self_attn.{q,k,v,o}_proj.bias     layers.N.attention.w{q,k,v,o}.bias (when present)
//   model.layers.N.self_attn.{q,k}_norm.weight       layers.N.attention.{q,k}_norm.weight (qwen3)
//   model.layers.N.mlp.{gate,up,down}_proj.weight    layers.N.feed_forward.w{1,3,2}.weight
//   model.layers.N.input_layernorm.weight            layers.N.attention_norm.weight
//   model.layers.N.post_attention_layernorm.weight   layers.N.ffn_norm.weight
//   model.norm.weight, lm_head.weight (absent when tied)   norm.weight, output.weight
//
// NOTE: [Rotary layouts] HF rotates the two halves of each head
// (rotate_half: dims i and i + head_dim/2), dtp rotates interleaved pairs
// (2i, 2i+1). The q and k projections' rows are permuted within each head on
// the way in and back on the way out (HF's convert_llama_weights_to_hf
// permutation), so logits equal HF's exactly:
//   dtp row 2i + j of a head  <->  HF row j * head_dim/2 + i.
// The same holds for their biases and for Qwen 3's q/k norm weights (one
// head each), which act on the rotated dimensions.
#pragma once

#include "dtp/models/llama.h"
#include "dtp/nn/quantize.h"
#include "dtp/process_group.h"

#include <functional>
#include <optional>
#include <string>

namespace dtp::models {

// The LlamaConfig of `dir`/config.json, by model_type: "llama", "mistral",
// "qwen2" or "qwen3" (NOTE: [Model families]). What dtp does not implement
// is an error naming the field and what is supported: another model_type,
// rope_type (yarn, dynamic, linear, ...), activation, mlp_bias, Qwen's
// use_sliding_window, layer_types other than full attention, a
// partial_rotary_factor. Transformers 5's rope_parameters is read as well as
// rope_theta + rope_scaling. max_position_embeddings becomes max_seq_len
// unless `max_seq_len` > 0 (the rotary tables hold max_seq_len rows per
// layer: cap it to the context you run).
LlamaConfig llama_config_from_hf(const std::string& dir, int64_t max_seq_len = 0);

struct HFLoadOptions {
  uint64_t buffer_bytes = uint64_t{16} << 20;  // NOTE: [Bounded box IO]
  // Set: the Linear layers to_weight_only converts (below) are stored as it
  // says (bfloat16, float16, or int8 quantized at load), each converted as
  // soon as it is read, so the float copy of one weight shard at a time is
  // all the load holds beyond the narrow model. The model's dtype stays the
  // computation's (NOTE: [Weight-only linears] in dtp/nn/quantize.h).
  std::optional<nn::WeightOnlyOptions> weight_only;
};

// Converts the model's Linear layers with nn::to_weight_only: attention and
// MLP projections (shared experts' too) and the output head. A tied head
// gets its own narrow copy of the embedding (decode reads the head every
// token, the embedding one row), so the embedding stays in the model's
// dtype beside it. Kept in the model's dtype: the embedding, norms, biases,
// MoE routers (as llama.cpp keeps ffn_gate_inp) and the stacked routed
// experts (NYI). After parallelizing, as the load does; the weights must be
// set. Collective only where nn::to_weight_only is. save_hf refuses the
// result (NYI).
void to_weight_only(Llama& model, const nn::WeightOnlyOptions& options);

// Fills every parameter of `model` (built from llama_config_from_hf, then
// parallelized any way, or not) from the folder's safetensors files, cast to
// the model's dtype (bf16, fp16, fp32 and fp64 files). Each rank reads only
// the bytes of its shards; the only collective checks that every rank of the
// model's mesh passed the same folder (none for a plain model). Missing or unexpected tensor
// names, shapes that disagree with the model, unsupported dtypes and
// truncated files are errors naming the tensor or file, raised before any
// parameter changes.
void load_hf_weights(Llama& model, const std::string& dir, const HFLoadOptions& options = {});

// NOTE: [Loading only the shards] Builds `config`'s Llama on the meta
// device (deferred_init: no memory), hands it to `parallelize` (TP, EP:
// whatever gives each rank its shards, allocated and not yet set; may be
// empty for one device), allocates what is still on the meta device (plain
// parameters, on config.device) and fills every parameter from the folder
// with load_hf_weights. Past construction (which still builds each block,
// the embedding and the head in full, one at a time, before moving it to
// the meta device: NOTE: [Deferred initialization]), no rank holds a
// parameter it does not keep: at TP=2 each rank's peak is about its half of
// the weights plus one read buffer (options.buffer_bytes), where building
// the model first (every rank drawing the whole model's random init, then
// sharding it) peaked at the whole model and more. The weights equal, bit
// for bit, those of Llama(config), parallelize, load_hf_weights. Collective
// where `parallelize` and load_hf_weights are.
//   Llama model = models::load_hf_model(llama_config_from_hf(dir), dir,
//       [&](Llama& m) { apply_tensor_parallel_for_inference(m, mesh); });
Llama load_hf_model(LlamaConfig config, const std::string& dir, const std::function<void(Llama&)>& parallelize,
                    const HFLoadOptions& options = {});

struct HFSaveOptions {
  // The dtype of the written weights; default: the model's.
  std::optional<c10::ScalarType> dtype;
  // Files are split as save_pretrained splits them (default 5 GB).
  uint64_t max_shard_bytes = uint64_t{5} << 30;
  // A folder whose config.json fields dtp does not own (bos/eos ids, ...) and
  // tokenizer files are carried over, e.g. the folder the model was loaded from.
  std::string source_dir;
  std::optional<ProcessGroup> group;  // default: the thread's default group
};

// Collective. Writes `model` as a HF folder: each rank writes the bytes of
// the shards it owns straight into the shared files (pwrite; replicas by the
// lowest rank holding them), rank 0 the headers, the index and config.json.
// Into an existing folder, as save_pretrained: the files are staged in
// "<dir>.incomplete", then moved in; model shards of the exporter's naming
// ("model.safetensors", "model-NNNNN-of-NNNNN.safetensors" and their index)
// that this export does not reuse are removed, and everything else stays:
// tokenizer files (the source's are copied only where the folder has none),
// README, the user's files. Exporting into the folder the model was loaded
// from works. Every rank must pass the same `dir`.
void save_hf(Llama& model, const std::string& dir, const HFSaveOptions& options = {});

// The HF name of a dtp parameter FQN ("layers.0.attention.wq.weight" ->
// "model.layers.0.self_attn.q_proj.weight").
std::string hf_name(const std::string& fqn);

}  // namespace dtp::models
