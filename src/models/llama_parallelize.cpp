// parallelize_llama and pipeline_llama: the techniques composed in
// torchtitan's order.
#include "dtp/models/parallelize.h"

#include "dtp/dcp/checkpoint.h"
#include "dtp/models/llama_pipeline.h"
#include "dtp/parallel_dims.h"
#include "mesh/flatten.h"
#include "models/llama_cp.h"
#include "models/moe_layers.h"
#include "mesh/select_dims.h"

#include <algorithm>
#include <memory>
#include <set>

namespace dtp::models {
namespace {

pp::Schedule makeSchedule(const PipelineOptions& o, int ranks) {
  const int m = o.microbatches > 0 ? o.microbatches : ranks * o.stages_per_rank;
  TORCH_CHECK(o.stages_per_rank >= 1, "pipeline_llama: stages_per_rank=", o.stages_per_rank, " must be >= 1.");
  TORCH_CHECK(o.stages_per_rank == 1 || o.schedule == "interleaved", "pipeline_llama: stages_per_rank=",
              o.stages_per_rank, " needs the interleaved schedule; ", o.schedule, " runs one stage per pp rank.");
  if (o.schedule == "gpipe") return pp::Schedule::gpipe(ranks, m);
  if (o.schedule == "1f1b") return pp::Schedule::one_f_one_b(ranks, m);
  if (o.schedule == "interleaved") return pp::Schedule::interleaved_1f1b(ranks, o.stages_per_rank, m);
  TORCH_CHECK(false, "pipeline_llama: unknown schedule '", o.schedule, "'. Use gpipe, 1f1b or interleaved.");
}

// What this rank's checkpoint entries are: its stages' parameters, by the
// whole model's names.
dcp::StateDictOptions ownEntries(const LlamaPipeline& pipe, Llama& model) {
  std::set<const void*> mine;
  for (const auto& p : pipe.parameters()) mine.insert(p.unsafeGetTensorImpl());
  auto names = std::make_shared<std::set<std::string>>();
  for (const auto& item : model->named_parameters())
    if (mine.count(item.value().unsafeGetTensorImpl())) names->insert(item.key());
  dcp::StateDictOptions options = llama_state_dict_options();
  options.keep = [names](const std::string& fqn) { return names->count(fqn) > 0; };
  return options;
}

// ParallelizeOptions::mp_policy, when set, in place of a technique's own.
template <class Options>
Options withPolicy(Options o, const std::optional<MixedPrecisionPolicy>& policy) {
  if (policy) o.mp_policy = *policy;
  return o;
}

// What does not divide under context parallelism stops here.
void checkCpComposes(const char* api, const LlamaConfig& c, const DeviceMesh& mesh, const ParallelMeshDims& d,
                     const ParallelizeOptions& o) {
  if (!d.cp) return;
  const int64_t cp = mesh.size(mesh.dim_index(*d.cp)), tp = d.tp ? mesh.size(mesh.dim_index(*d.tp)) : 1;
  const int64_t heads = c.n_heads / tp;
  TORCH_CHECK(o.cp.attention != ContextParallelAttention::AllToAll || heads % cp == 0, api, ": all-to-all "
              "attention over cp ", cp, " with ", heads, " query heads per rank (n_heads / tp = ", heads * tp, " / ",
              tp, "): got a head count that does not divide by cp, expected a multiple of ", cp, ". Use ring attention "
              "(ContextParallelOptions::attention Ring), or a cp dividing ", heads, ".");
}

// NOTE: [Expert parallelism with data parallelism] On a (dp, ep[, tp])
// mesh (ParallelDims': (dp_shard_mod_ep, dp_shard_in_ep[, tp])), ep borrows
// from data parallelism, as torchtitan's does: every (dp, ep) rank feeds its
// own slice of the batch, and
// - the experts are Shard(0) over ep (apply_expert_parallel); an expert's
//   gradient then sums over the ep ranks' tokens, so data parallelism over
//   dp alone completes it, divided by dp x ep (not dp) to give the mean;
//   the experts are a data-parallel unit of their own on mesh[{dp, ep}];
// - every other parameter is data parallel over dp x ep: (dp, ep) is
//   flattened on the user's mesh as "dp_shard_cp" (torchtitan's name for
//   FSDP's dimension, which ParallelDims registers itself), and the model is
//   parallelized on root[{"dp_shard_cp", "tp"}]: TP over its "tp", FSDP or
//   DDP over its "dp_shard_cp". Every parameter thus lives on the user's
//   mesh or a slice of it (get_root_mesh() is the mesh init_device_mesh
//   made), with the mesh's own groups.
// Under TP the experts are replicated over tp (every tp rank dispatches the
// same tokens among its ep peers).

// NOTE: [Context parallelism with expert parallelism] On a (dp, ep, cp[, tp])
// mesh (ParallelDims': (dp_shard_mod_ep, dp_shard_in_ep, cp[, tp]), ep =
// dp_shard_in_ep x cp), the cp ranks of a row share its sequences and split
// their positions; the MoE layers work token by token, so for them a cp rank
// is one more data-parallel rank with its own tokens, and expert parallelism
// borrows cp's ranks as torchtitan's does:
// - dispatch: the experts are Shard(0) over ep x cp, one 1-D mesh flattened
//   from (ep, cp) (ParallelDims' "ep"; "ep_cp" on a hand-built mesh whose own
//   "ep" takes the name), and every MoE layer's all-to-alls run over it:
//   ep = cp = 2 puts experts [0, E/2) on cp rank 0, each rank sending its
//   positions' routed rows to their owners;
// - the experts' gradient sums over the ep x cp ranks' tokens in the
//   dispatch and over dp in their data parallelism (on mesh[{dp, ep x cp}]),
//   divided by dp x ep x cp: the ranks whose losses were summed. Each rank's
//   loss is its positions' mean weighted by S_r * cp / S (NOTE:
//   [Context-parallel loss]), so the sum over the ranks is dp x cp times one
//   device's loss, and that divide factor gives one device's gradient;
// - every other parameter is data parallel over dp x ep x cp (the mesh's
//   "dp_shard_cp", as with cp alone), the attention runs over cp as without
//   ep (apply_context_parallel on mesh["cp"]), and TP, when there, as above;
// - the load-balancing loss sums its counts over cp too (NOTE:
//   [Load-balancing loss under context parallelism] in src/models/llama_ep.cpp).
// Per MoE layer and step the collectives are those of expert parallelism over
// ep x cp ranks (one all_gather of the counts, 2 all_to_alls forward and 2
// backward); cp adds none of its own to the layer.
void parallelizeWithExperts(Llama& model, const DeviceMesh& mesh, const ParallelMeshDims& d,
                            const ParallelizeOptions& options) {
  TORCH_CHECK(!d.dp_replicate, "NYI: expert parallelism with HSDP: parallelize_llama on ", mesh.str(), ", which has "
              "\"", *d.dp_replicate, "\" and an expert-parallel dimension \"", *d.ep, "\". Build the mesh without "
              "dp_replicate (ParallelDims dp_replicate(1)).");
  std::vector<std::string> want;
  if (d.dp_shard) want.push_back(*d.dp_shard);
  want.push_back(*d.ep);
  if (d.cp) want.push_back(*d.cp);
  if (d.tp) want.push_back(*d.tp);
  TORCH_CHECK(d.dp_shard && mesh.mesh_dim_names() == want, "parallelize_llama: ", mesh.str(), " has an \"", *d.ep,
              "\" dimension; with expert parallelism the mesh's dimensions are (\"dp\", \"ep\", \"tp\") or (\"dp\", "
              "\"ep\"), in this order, with \"cp\" after \"ep\" under context parallelism (\"dp\" and \"ep\" may have "
              "size 1: the parameters outside the experts are data parallel over dp x ep x cp). Build it with "
              "init_device_mesh(\"cpu\", {dp, ep, tp}, {\"dp\", \"ep\", \"tp\"}), or with "
              "ParallelDims().ep(ep)...build_mesh().");
  const DeviceMesh root = mesh.get_root_mesh();
  // The experts' ranks: ep, or under cp ep x cp flattened (NOTE: [Context
  // parallelism with expert parallelism]).
  const std::string ep_name = !d.cp ? *d.ep : *d.ep == "ep" ? "ep_cp" : "ep";
  const DeviceMesh ep_mesh = d.cp ? mesh[{*d.ep, *d.cp}].flatten(ep_name) : mesh[*d.ep];
  const DeviceMesh experts_mesh = d.cp ? root[{*d.dp_shard, ep_name}] : mesh[{*d.dp_shard, *d.ep}];
  const DeviceMesh dense_dp = experts_mesh.flatten("dp_shard_cp");
  const DeviceMesh dense = d.tp ? root[{"dp_shard_cp", *d.tp}] : dense_dp;
  apply_expert_parallel(model, ep_mesh);
  TensorParallelOptions tp = options.tp;
  if (d.cp) tp.seq_len = 0;  // as without ep: each cp rank's S_local varies when S does not divide
  if (d.tp) apply_tensor_parallel(model, dense, tp);
  if (d.cp) apply_context_parallel(model, mesh[*d.cp], options.cp);
  if (options.ac) apply_ac(model, *options.ac);
  const double factor = static_cast<double>(experts_mesh.size());
  if (options.data_parallel == DataParallel::FSDP) {
    FullyShardOptions experts = withPolicy(options.fsdp, options.mp_policy);
    experts.gradient_divide_factor = factor;
    for (MoEImpl* moe : detail::moe_layers(model)) fully_shard(*moe->experts, experts_mesh, experts);
    apply_fsdp(model, dense, withPolicy(options.fsdp, options.mp_policy));
  } else {
    ReplicateOptions experts = withPolicy(options.ddp, options.mp_policy);
    experts.gradient_divide_factor = factor;
    for (MoEImpl* moe : detail::moe_layers(model)) replicate(*moe->experts, experts_mesh, experts);
    apply_ddp(model, dense, withPolicy(options.ddp, options.mp_policy));
  }
}

}  // namespace

void parallelize_llama(Llama& model, const DeviceMesh& mesh, const ParallelizeOptions& options) {
  const ParallelMeshDims d = parallel_mesh_dims(mesh);
  TORCH_CHECK(!d.pp, "parallelize_llama: ", mesh.str(), " has a \"pp\" dimension. Cut the model into "
              "stages with pipeline_llama, which parallelizes each stage over the other dimensions.");
  checkCpComposes("parallelize_llama", model->config, mesh, d, options);
  if (d.ep) return parallelizeWithExperts(model, mesh, d, options);
  // torchtitan shards only over dp_shard (and cp); dp_replicate alone is DDP's.
  TORCH_CHECK(d.dp_shard || d.cp || !d.dp_replicate || options.data_parallel == DataParallel::DDP, "parallelize_llama: ",
              mesh.str(), " has \"", d.dp_replicate.value_or(""), "\" and no dimension to shard over (\"dp\" or "
              "\"dp_shard\"), expected one for FSDP. Pass data_parallel = DataParallel::DDP (torchtitan's choice for "
              "dp_replicate alone), or give the mesh a dp_shard dimension (ParallelDims dp_shard > 1).");
  TensorParallelOptions tp = options.tp;
  if (d.cp) tp.seq_len = 0;  // SP cuts each cp rank's S_local, which varies by rank when S does not divide
  if (d.tp) apply_tensor_parallel(model, mesh, tp);
  // See NOTE: [Context parallelism in the Llama] in src/models/llama_cp.cpp.
  if (d.cp) apply_context_parallel(model, mesh[*d.cp], options.cp);
  if (options.ac) apply_ac(model, *options.ac);
  if (!d.dp_shard && !d.dp_replicate && !d.cp) {
    if (options.mp_policy) apply_mixed_precision(*model, *options.mp_policy);  // TP only
    return;
  }
  if (options.data_parallel == DataParallel::FSDP) apply_fsdp(model, mesh, withPolicy(options.fsdp, options.mp_policy));
  else apply_ddp(model, mesh, withPolicy(options.ddp, options.mp_policy));
}

ProcessGroup data_parallel_group(const DeviceMesh& mesh) {
  const ParallelMeshDims d = parallel_mesh_dims(mesh);
  TORCH_CHECK(!d.pp, "data_parallel_group: ", mesh.str(), " has a \"pp\" dimension. Pass the mesh "
              "without it (each pipeline rank's data-parallel peers are the same dimensions).");
  TORCH_CHECK(!d.batch.empty(), "data_parallel_group: ", mesh.str(), " has no data-parallel dimension (\"dp\", "
              "\"dp_replicate\", \"dp_shard\" or \"ep\"): every rank trains on the whole batch.");
  std::vector<int64_t> dims;
  for (const auto& name : d.batch) dims.push_back(mesh.dim_index(name));
  return dims.size() == 1 ? mesh.get_group(dims[0]) : flattened_group(mesh, dims, "data_parallel_group");
}

std::vector<at::Tensor> LlamaPipeline::parameters() const {
  std::vector<at::Tensor> out;
  std::set<const void*> seen;
  for (const auto& stage : stages)
    for (const auto& p : stage->parameters())
      if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  return out;
}

void LlamaPipeline::init_weights(Llama model) const {
  models::init_weights(model, parameters());
  for (Llama stage : stages) stage->awaiting_init = false;  // a handle: the stage itself
}

dcp::StateDict LlamaPipeline::state_dict(Llama model, torch::optim::Optimizer* optimizer) const {
  return dcp::get_state_dict(*model, optimizer, ownEntries(*this, model));
}

std::map<std::string, std::string> LlamaPipeline::load_state(const std::string& dir, Llama model,
                                                             torch::optim::Optimizer* optimizer) const {
  return dcp::load_state(dir, *model, optimizer, ownEntries(*this, model));
}

LlamaPipeline pipeline_llama(const Llama& model, const DeviceMesh& mesh, const PipelineOptions& pipeline,
                             ParallelizeOptions options) {
  const ParallelMeshDims d = parallel_mesh_dims(mesh);
  checkCpComposes("pipeline_llama", model->config, mesh, d, options);
  TORCH_CHECK(d.pp, "pipeline_llama: ", mesh.str(), " has no \"pp\" dimension. Name one mesh "
              "dimension \"pp\" (e.g. init_device_mesh(\"cpu\", {pp, dp, tp}, {\"pp\", \"dp\", \"tp\"})), or use "
              "parallelize_llama without a pipeline.");
  const int64_t pp_dim = mesh.dim_index(*d.pp);
  const int ranks = static_cast<int>(mesh.size(pp_dim)), me = static_cast<int>(mesh.get_local_rank(pp_dim));
  pp::Schedule schedule = makeSchedule(pipeline, ranks);
  // The rest of the mesh, in its order: what each stage is parallelized on.
  std::vector<int64_t> rest;
  for (int64_t k = 0; k < mesh.ndim(); ++k)
    if (k != pp_dim) rest.push_back(k);
  const std::optional<DeviceMesh> inner = rest.empty() ? std::nullopt : std::optional(select_mesh_dims(mesh, rest));
  options.tp.sequence_parallel = false;  // plain activations between stages (see the header)

  LlamaPipeline out;
  std::vector<pp::PipelineStage> stages;
  for (int s = 0; s < schedule.stages(); ++s) {
    if (schedule.rank_of(s) != me) continue;
    Llama part = llama_pipeline_stage(model, s, schedule.stages(), pipeline.split);
    if (inner) parallelize_llama(part, *inner, options);
    else if (options.mp_policy) apply_mixed_precision(*part, *options.mp_policy);  // pp alone
    out.stages.push_back(part);
    stages.push_back({s, [part](const at::Tensor& x) mutable { return part(x); }, {}});
    out.has_last_stage = out.has_last_stage || s == schedule.stages() - 1;
  }
  pp::LossFn loss = [](const at::Tensor& logits, const at::Tensor& targets) { return llama_loss(logits, targets); };
  if (d.cp) {  // See NOTE: [Context parallelism in a pipeline] in src/models/llama_cp.cpp.
    detail::share_context_parallel(model, out.stages);
    loss = [whole = Llama(model)](const at::Tensor& logits, const at::Tensor& targets) {
      return llama_loss(whole, logits, targets);
    };
  }
  out.pipeline = std::make_shared<pp::Pipeline>(std::move(schedule), std::move(stages), mesh.get_group(pp_dim),
                                                std::move(loss));
  return out;
}

}  // namespace dtp::models
