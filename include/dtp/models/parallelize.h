// The reference Llama's parallelisms composed in torchtitan's order, as its
// parallelize_llama and pipeline_llama do:
//   apply_tensor_parallel -> apply_ac -> apply_fsdp / apply_ddp -> pipeline.
//
//   auto mesh = dtp::init_device_mesh("cpu", {2, 2, 2}, {"pp", "dp", "tp"});
//   Llama model(config);                                  // every rank: the whole model
//   auto pipe = pipeline_llama(model, mesh, {"1f1b", 4}, {/*tp*/ {}, ACOptions{}});
//   at::Tensor loss = pipe.pipeline->step(tokens, targets);  // defined on the last stage
//
// Each mesh dimension is found by name: "tp" (tensor parallelism), "dp"
// (data parallelism), or HSDP's "dp_replicate" and "dp_shard", "ep" (expert
// parallelism, borrowed from data parallelism: a (dp, ep[, tp]) mesh, NOTE:
// [Expert parallelism with data parallelism]), and "pp". A mesh from
// ParallelDims::build_mesh (torchtitan's names, dtp/parallel_dims.h) reads
// alike: parallel_mesh_dims decides the names once. A "cp" dimension is
// context parallelism (apply_context_parallel), composed with "tp" and the
// data-parallel dimensions (FSDP or DDP over dp_shard x cp) and, through
// pipeline_llama, with "pp" (every stage's attention over cp), and with "ep"
// (the experts over ep x cp, as torchtitan's ep = dp_shard_in_ep x cp: a
// (dp, ep, cp[, tp]) mesh, NOTE: [Context parallelism with expert
// parallelism]), also inside pipeline_llama's stages.
//
//   auto mesh = dtp::ParallelDims().tp(2).ep(2).world_size(8).build_mesh();
//   parallelize_llama(model, mesh);  // (dp_shard_mod_ep=2, dp_shard_in_ep=2, tp=2)
//
//   auto cp_mesh = dtp::ParallelDims().cp(2).tp(2).world_size(8).build_mesh();  // (dp_shard=2, cp=2, tp=2)
//   parallelize_llama(model, cp_mesh);
//   auto in = context_parallel_shard_batch(model, {tokens, labels});  // this rank's positions
//   llama_loss(model, model(in[0]), in[1]).backward();
#pragma once
// Read by dtp/models/llama.h (NOTE: [Deprecated forwarding]): a translation
// unit that includes this header first gets no deprecation note.
#define DTP_MODELS_PARALLELIZE_H

#include "dtp/ac/activation_checkpoint.h"
#include "dtp/amp/mixed_precision.h"
#include "dtp/dcp/state_dict.h"
#include "dtp/device_mesh.h"
#include "dtp/fsdp/fully_shard.h"
#include "dtp/fsdp/replicate.h"
#include "dtp/models/llama.h"
#include "dtp/parallel_dims.h"
#include "dtp/pp/pipeline.h"
#include "dtp/process_group.h"
#include "dtp/tp/parallelize.h"

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dtp::models {

// Each parallelism of the Llama on its own; parallelize_llama below composes
// them in torchtitan's order.

// The "tp" dimension of `mesh`, or nothing when it has none.
std::optional<DeviceMesh> get_tp_mesh(const DeviceMesh& mesh);

struct TensorParallelOptions {
  bool sequence_parallel = true;
  int64_t seq_len = 0;  // the training sequence length, checked under SP (0: unchecked)
  // tp > n_kv_heads (tp a multiple of it): wk and wv stay replicated and
  // rank r attends with KV head r / (tp / n_kv_heads), as vLLM does. Set by
  // apply_tensor_parallel_for_inference; training with it is untested.
  bool replicate_kv_heads = false;
  // MoE layers: false, every tp rank computes every routed token's experts
  // (replicated, no communication inside); true, ExpertTensorParallel on
  // "layers.*.moe.experts": each expert's hidden units cut over tp and the
  // layer's output reduced over tp as a RowwiseParallel's. Not with
  // apply_expert_parallel.
  bool shard_experts = false;
  // A plan of the user's in place of llama_tp_plan's (FQNs of the whole
  // model, e.g. "layers.*.attention.wq"). Whatever it leaves plain is
  // replicated; the head-count checks still run.
  std::optional<ParallelizePlan> plan;
};

// The family's tensor-parallel plan as data, torchtitan's for Llama, for
// `c` and a tp degree of `tp` (NOTE: [Model families]):
//   layers.*.attention              PrepareModuleInput (R, gradient boundary)
//   layers.*.attention.w{q,k,v}     ColwiseParallel (a bias is Shard(0) with its weight)
//   layers.*.attention.{q,k}_norm   PrepareModuleInputOutput S(2) -> S(2), local:
//                                   this rank's heads, no communication (qk_norm)
//   layers.*.attention.wo           RowwiseParallel, output S(1) under SP, else R
//   layers.*.feed_forward           PrepareModuleInput (R, gradient boundary)
//   layers.*.feed_forward.w{1,3}    ColwiseParallel
//   layers.*.feed_forward.w2        RowwiseParallel
//   layers.*.moe                    PrepareModuleInputOutput -> R -> residual (MoE: experts replicated)
//   layers.*.{attention,ffn}_norm   SequenceParallel (SP)
//   tok_embeddings                  RowwiseParallel, output S(1) under SP, else R
//   norm                            SequenceParallel (SP)
//   output                          ColwiseParallel, vocab-sharded logits S(-1)
// A pipeline stage (no embedding or head) gets it without SP.
ParallelizePlan llama_tp_plan(const LlamaConfig& c, int64_t tp, const TensorParallelOptions& options = {});

// Parallelizes the model over mesh["tp"] with llama_tp_plan (or
// options.plan). A mesh without "tp" leaves the model unchanged with a
// warning. Validation happens before anything changes.
void apply_tensor_parallel(Llama& model, const DeviceMesh& mesh, TensorParallelOptions options = {});

// Activation checkpointing of the transformer blocks, as torchtitan's
// apply_ac (after TP, before FSDP): every `every`-th block (1: all) in
// `mode` (see ac/activation_checkpoint.h).
struct ACOptions {
  ACMode mode = ACMode::Full;
  int64_t every = 1;
  std::vector<std::string> save_ops = default_sac_save_ops();  // ACMode::Selective keeps these ops' outputs
};
void apply_ac(Llama& model, ACOptions options = {});

// Data parallelism over mesh["dp"] after apply_tensor_parallel, as
// torchtitan's apply_fsdp: each transformer block is a fully_shard unit, the
// root (embedding, final norm, head) the last one. A 1-D mesh is dp alone.
void apply_fsdp(Llama& model, const DeviceMesh& mesh, FullyShardOptions options = {});

// Expert parallelism over mesh["ep"] (NOTE: [Expert parallelism] in
// src/models/moe.cpp): every MoE layer's experts become Shard(0) over ep and
// tokens travel to their experts' ranks by all-to-all. Each ep rank feeds
// its own tokens; alone, the other parameters' gradients are this rank's
// tokens' only. For training, parallelize_llama on a (dp, ep[, tp]) mesh
// composes it with TP and FSDP or DDP (NOTE: [Expert parallelism with data
// parallelism] in src/models/llama_parallelize.cpp).
void apply_expert_parallel(Llama& model, const DeviceMesh& mesh);

// Data parallelism over mesh["dp"] after apply_tensor_parallel, as
// torchtitan's apply_ddp: replicate() on the whole model.
void apply_ddp(Llama& model, const DeviceMesh& mesh, ReplicateOptions options = {});

// Where the serving engine's KV cache lives under cp (ContextParallelOptions::kv_cache).
enum class CpKvCache : uint8_t { Replicated, Sharded };

// Which exact attention runs over the cp group (dtp/cp/context_parallel.h).
enum class ContextParallelAttention : uint8_t {
  Ring,      // ring_attention: key/value chunks around the ring, any head count
  AllToAll,  // all_to_all_attention (Ulysses): heads per rank must divide by cp
};

struct ContextParallelOptions {
  ContextParallelAttention attention = ContextParallelAttention::Ring;
  // HeadTail: torchtitan's load balancing for the causal mask (each rank one
  // early and one late chunk); Contiguous: torch.chunk, the naive layout.
  CpLayout layout = CpLayout::HeadTail;
  // The global sequence length until context_parallel_shard_batch records
  // the batch's; 0: cp * S_local (the even case).
  int64_t seq_len = 0;
  // The serving engine's KV cache (engine_model, generate): Replicated, each
  // cp rank holds every block and decode sends nothing over cp; or Sharded,
  // block b on cp rank b % cp, so a rank holds 1/cp of the cache and the pool
  // holds cp times what one rank's budget would, for one all_gather per layer
  // and call (vLLM's decode context parallelism; NOTE: [KV cache sharded over
  // cp] in dtp/inference/kv_cache.h).
  CpKvCache kv_cache = CpKvCache::Replicated;
};

// Context parallelism over the 1-D mesh `cp_mesh` (mesh["cp"]): every
// attention layer runs `options.attention` over its group on the sequence
// that `options.layout` shards, with rotary positions of the layout
// (context_parallel_position_ids). The parameters stay as they are: their
// gradients hold this rank's positions only, and data parallelism over
// dp_shard x cp completes them (parallelize_llama does that; NOTE: [Data
// parallelism over cp] in src/fsdp/data_parallel.cpp). Feed the model with
// context_parallel_shard_batch and train with llama_loss(model, ...)
// (sliding windows too: ring and all-to-all attention mask by the
// window). generate and
// the serving engine (engine_model) prefill a prompt over cp, then decode
// on every cp rank alike, over a KV cache replicated or sharded over cp
// (options.kv_cache; NOTE: [Context-parallel prefill] in
// src/models/llama_cp_prefill.cpp); the KV-cache forward itself
// (model->forward(tokens, cache, valid)) is NYI under it.
void apply_context_parallel(Llama& model, const DeviceMesh& cp_mesh, ContextParallelOptions options = {});

enum class DataParallel : uint8_t { FSDP, DDP };

struct ParallelizeOptions {
  TensorParallelOptions tp;
  ContextParallelOptions cp;  // on a mesh with a "cp" dimension
  std::optional<ACOptions> ac;  // none: no activation checkpointing
  DataParallel data_parallel = DataParallel::FSDP;
  FullyShardOptions fsdp;
  ReplicateOptions ddp;
  // Mixed precision for every layout: set, it is FSDP's or DDP's mp_policy
  // (in place of fsdp.mp_policy / ddp.mp_policy), and on a mesh without
  // data parallelism (TP only; a pipeline stage alone) apply_mixed_precision
  // on the model after TP and AC.
  std::optional<MixedPrecisionPolicy> mp_policy;
};

// On a whole model or a pipeline stage, on a mesh without "pp": tensor
// parallelism over "tp" if the mesh has it, then context parallelism over
// "cp" if it has it, then activation checkpointing if asked, then FSDP or
// DDP over the data-parallel dimensions if it has any (with "cp": over
// dp_shard x cp, even with cp alone, as torchtitan; with options.mp_policy
// as theirs), or else, with options.mp_policy, apply_mixed_precision.
void parallelize_llama(Llama& model, const DeviceMesh& mesh, const ParallelizeOptions& options = {});

// The ranks that train on slices of one batch, for the data loader and
// moe_load_balancing_loss: "dp", HSDP's dp_replicate x dp_shard, or
// dp x ep (ParallelMeshDims::batch; on a ParallelDims mesh, the group of
// its flattened "dp"). Collective the first time (it may make the group);
// `mesh` has no "pp" (pass a stage's mesh) and at least one of these
// dimensions.
ProcessGroup data_parallel_group(const DeviceMesh& mesh);

struct PipelineOptions {
  std::string schedule = "1f1b";   // gpipe, 1f1b, or interleaved (interleaved 1F1B)
  int microbatches = 0;            // per step; 0: as many as stages
  int stages_per_rank = 1;         // interleaved: virtual stages per pp rank
  std::vector<int64_t> split;      // each stage's first layer; empty: even
};

// This pp rank's part of a pipeline over mesh["pp"].
struct LlamaPipeline {
  std::vector<Llama> stages;                // this rank's, parallelized
  std::shared_ptr<pp::Pipeline> pipeline;   // step(tokens, targets)
  bool has_last_stage = false;              // this rank computes the loss
  // This rank's parameters, each once (for the optimizer).
  std::vector<at::Tensor> parameters() const;
  // For `model` built with deferred_init: allocates and sets this rank's
  // parameters only (one device's values), the rest of the model staying on
  // the meta device (init_weights(model, parameters())).
  void init_weights(Llama model) const;
  // A checkpoint of this rank's stages named as the whole model's (`model`:
  // what pipeline_llama cut): their parameters and `optimizer`'s state of
  // them, for dcp::save or dcp::AsyncSaver. Every rank saving its own, the
  // folder holds the whole model.
  dcp::StateDict state_dict(Llama model, torch::optim::Optimizer* optimizer) const;
  // Fills this rank's stages and `optimizer`'s state from a checkpoint folder
  // of the whole model: saved by state_dict at any pp layout and split, or
  // by dcp::save_state of the whole model at any (dp, tp) layout. Returns its
  // metadata. Collective over every rank of the pipeline.
  std::map<std::string, std::string> load_state(const std::string& dir, Llama model,
                                                torch::optim::Optimizer* optimizer) const;
  // The MoE load-balancing loss (moe_load_balancing_loss's, HF's) over the
  // whole step: every stage's MoE layers and every microbatch, added to the
  // loss pipeline->step returns on the last stage, its gradient into every
  // stage's routers. Counts sum over the microbatches, the pp group (one
  // all_reduce per step), `data_parallel` (the rows' group, as
  // moe_load_balancing_loss takes it) and cp. Needs a GPipe schedule (every
  // forward before the first backward): 1F1B is an error saying so
  // (NOTE: [Load-balancing loss in a pipeline] in src/models/llama_ep.cpp).
  // Collective: every rank of the pipeline calls it once, after
  // pipeline_llama.
  void add_load_balancing_loss(const std::optional<ProcessGroup>& data_parallel = std::nullopt) const;
};

// Cuts `model` into pp * stages_per_rank stages (llama_pipeline_stage), keeps
// this rank's, parallelizes each with parallelize_llama over the mesh's other
// dimensions and runs them under the schedule with llama_loss. With a "cp"
// dimension every stage's attention runs over cp and `model` shares the
// stages' context parallelism: cut the batch with
// context_parallel_shard_batch(model, {tokens, labels}) before
// pipeline->step, whose loss_fn is then llama_loss(model, ...) (NOTE:
// [Context parallelism in a pipeline] in src/models/llama_cp.cpp). Stages get
// tensor parallelism without sequence parallelism, as KempnerForge does:
// activations between stages are then plain tensors, each tp rank sending
// its (replicated) copy to the same tp rank of the next stage. The model's
// modules are shared, not copied: model->named_parameters() names them as
// the whole model does.
LlamaPipeline pipeline_llama(const Llama& model, const DeviceMesh& mesh, const PipelineOptions& pipeline,
                             ParallelizeOptions options = {});

}  // namespace dtp::models
