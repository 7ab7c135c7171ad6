// llama_tp_plan and apply_tensor_parallel: the torchtitan plan for the
// reference decoder's families, as data.
#include "dtp/distribute_module.h"
#include "dtp/dtensor.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/tp/parallelize.h"

#include <algorithm>

namespace dtp::models {

std::optional<DeviceMesh> get_tp_mesh(const DeviceMesh& mesh) {
  for (const auto& name : mesh.mesh_dim_names())
    if (name == "tp") return mesh.ndim() == 1 ? mesh : mesh["tp"];
  return std::nullopt;
}

namespace {

void checkDivisible(const char* what, int64_t value, int64_t tp, const char* fix) {
  TORCH_CHECK(value % tp == 0, "apply_tensor_parallel: ", what, "=", value, " is not divisible by the tp degree ",
              tp, ". ", fix);
}

bool replicatesKvHeads(const LlamaConfig& c, int64_t tp, const TensorParallelOptions& options) {
  return options.replicate_kv_heads && tp > c.n_kv_heads;
}

bool isStage(const LlamaConfig& c) { return !c.with_embedding || !c.with_head; }

void validate(const LlamaConfig& c, int64_t tp, const TensorParallelOptions& options) {
  checkDivisible("n_heads", c.n_heads, tp, "Use a tp degree that divides n_heads, or change n_heads.");
  if (replicatesKvHeads(c, tp, options)) {
    TORCH_CHECK(tp % c.n_kv_heads == 0, "apply_tensor_parallel: tp=", tp, " > n_kv_heads=", c.n_kv_heads,
                " replicates KV heads only when tp is a multiple of n_kv_heads. Use a tp degree that divides or is a "
                "multiple of n_kv_heads.");
  } else {
    checkDivisible("n_kv_heads", c.n_kv_heads, tp,
                   options.replicate_kv_heads
                       ? "Use a tp degree that divides n_kv_heads, or a multiple of it (KV heads are then replicated)."
                       : "Use a tp degree that divides n_kv_heads, or raise n_kv_heads (up to n_heads); for inference, "
                         "apply_tensor_parallel_for_inference replicates KV heads when tp is a multiple of n_kv_heads.");
  }
  if (options.sequence_parallel && !isStage(c) && options.seq_len > 0)
    checkDivisible("seq_len", options.seq_len, tp,
                   "Sequence parallelism shards the sequence evenly: use a multiple of tp, or disable it "
                   "(--no-sp).");
}

}  // namespace

ParallelizePlan llama_tp_plan(const LlamaConfig& c, int64_t tp, const TensorParallelOptions& options) {
  const bool sp = options.sequence_parallel && !isStage(c);
  // Activations between blocks: sequence-sharded under SP, else replicated;
  // kept as DTensors (use_local_output = false) so dropout draws the same
  // mask as one device.
  const Placement residual = sp ? Placement(Shard(1)) : Placement(Replicate());
  // Megatron's f at the input of each module holding Colwise projections
  // after a norm (attention, MLP, the head): their Partial gradients are
  // summed and reduced once there, so the norm gets a Replicate gradient and
  // its weight needs no all-reduce of its own. Under SP the all-gather of the
  // sequence is that boundary already.
  const auto gather_input = PrepareModuleInput(PrepareModuleInputOptions()
                                                   .input_layouts({residual})
                                                   .desired_input_layouts({Replicate()})
                                                   .gradient_boundary(true));
  const auto rowwise_out = RowwiseParallel(RowwiseParallelOptions().output_layouts(residual).use_local_output(false));
  // q/k norms see this rank's heads, plain [batch, seq, heads / tp, head_dim]
  // (the Colwise projections' local outputs): they run there as Shard(2) and
  // return local tensors. The weight's gradient is Partial (each rank's
  // heads' part), reduced like the SP norms'.
  const auto local_heads = PrepareModuleInputOutput(
      PrepareModuleInputOptions().input_layouts({Shard(2)}).desired_input_layouts({Shard(2)}),
      PrepareModuleOutputOptions().output_layouts(Shard(2)).desired_output_layouts(Shard(2)).use_local_output(true));

  // torchtitan's layer_plan: every transformer block alike.
  ParallelizePlan layer_plan;
  if (sp) layer_plan.insert(layer_plan.end(), {{"attention_norm", SequenceParallel()}, {"ffn_norm", SequenceParallel()}});
  layer_plan.emplace_back("attention", gather_input);
  layer_plan.emplace_back("attention.wq", ColwiseParallel());
  if (!replicatesKvHeads(c, tp, options)) {  // else wk and wv stay replicated (apply_tensor_parallel)
    layer_plan.emplace_back("attention.wk", ColwiseParallel());
    layer_plan.emplace_back("attention.wv", ColwiseParallel());
  }
  if (c.qk_norm) {
    layer_plan.emplace_back("attention.q_norm", local_heads);
    layer_plan.emplace_back("attention.k_norm", local_heads);
  }
  layer_plan.emplace_back("attention.wo", rowwise_out);
  if (c.moe.num_experts > 0) {
    // Experts replicated (every tp rank runs the layer on the gathered
    // input; apply_expert_parallel spreads them instead) or cut by
    // shard_experts (a Partial output), the output back to the residual's
    // layout.
    layer_plan.emplace_back("moe", PrepareModuleInputOutput(PrepareModuleInputOptions()
                                                                .input_layouts({residual})
                                                                .desired_input_layouts({Replicate()}),
                                                            PrepareModuleOutputOptions()
                                                                .output_layouts(Replicate())
                                                                .desired_output_layouts(residual)
                                                                .use_local_output(false)));
    if (options.shard_experts) layer_plan.emplace_back("moe.experts", ExpertTensorParallel());
    if (c.moe.shared_hidden > 0) {  // the shared expert is cut as the dense MLP, on the gathered input
      layer_plan.emplace_back("moe.shared_expert.w1", ColwiseParallel());
      layer_plan.emplace_back("moe.shared_expert.w3", ColwiseParallel());
      layer_plan.emplace_back("moe.shared_expert.w2",
                              RowwiseParallel(RowwiseParallelOptions().output_layouts(Replicate()).use_local_output(false)));
    }
  } else {
    layer_plan.emplace_back("feed_forward", gather_input);
    layer_plan.emplace_back("feed_forward.w1", ColwiseParallel());
    layer_plan.emplace_back("feed_forward.w2", rowwise_out);
    layer_plan.emplace_back("feed_forward.w3", ColwiseParallel());
  }
  // The rest of the model: the embedding, the final norm, the head.
  ParallelizePlan plan;
  if (c.with_embedding)
    plan.emplace_back("tok_embeddings", RowwiseParallel(RowwiseParallelOptions()
                                                            .input_layouts(Replicate())
                                                            .output_layouts(residual)
                                                            .use_local_output(false)));
  if (c.with_head) {
    plan.emplace_back("output", ColwiseParallel(ColwiseParallelOptions()
                                                    .input_layouts(residual)
                                                    .output_layouts(Shard(-1))
                                                    .use_local_output(false)));
    if (!sp) plan.emplace_back("output", gather_input);
  }
  if (sp) plan.emplace_back("norm", SequenceParallel());
  if (c.n_layers > 0) {  // one plan, so that it is validated before anything changes
    for (PlanEntry e : layer_plan) {
      e.pattern = "layers.*." + e.pattern;
      plan.push_back(std::move(e));
    }
  }
  return plan;
}

void apply_tensor_parallel(Llama& model, const DeviceMesh& mesh, TensorParallelOptions options) {
  auto tp_mesh = get_tp_mesh(mesh);
  if (!tp_mesh) {
    TORCH_WARN("apply_tensor_parallel: ", mesh.str(), " has no \"tp\" dimension; the model stays "
               "unparallelized. Name a mesh dimension \"tp\" to shard it.");
    return;
  }
  const LlamaConfig& c = model->config;
  const int64_t tp = tp_mesh->size();
  validate(c, tp, options);
  parallelize_module(*model, *tp_mesh, options.plan ? *options.plan : llama_tp_plan(c, tp, options));
  if (replicatesKvHeads(c, tp, options)) {
    // vLLM's rule: rank r's query heads share KV head r / (tp / n_kv_heads).
    const int64_t kvHead = tp_mesh->get_local_rank(0) / (tp / c.n_kv_heads);
    for (const auto& layer : *model->layers) {
      layer->as<dtp::nn::HookedImpl<TransformerBlockImpl>>()->attention->kv_head = kvHead;
    }
  }

  // Whatever the plan left plain (the norms without SP) is replicated. A
  // stage takes and returns plain activations, replicated on every rank.
  if (!isStage(c)) {
    distribute_module(*model, *tp_mesh);
    return;
  }
  distribute_module(
      *model, *tp_mesh, nullptr,
      [](std::vector<at::Tensor>& in, const DeviceMesh& m) {
        if (!is_dtensor(in[0])) in[0] = from_local(in[0], m, {Replicate()}, /*run_check=*/false);
      },
      [](at::Tensor& out, const DeviceMesh& m) { out = to_local(redistribute(out, m, {Replicate()})); });
}

}  // namespace dtp::models
