// apply_fsdp, apply_ddp: torchtitan's data-parallel wrappings of the reference Llama.
#include "dtp/dtensor.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "models/apply_on.h"
#include "nn/applied.h"

#include <algorithm>

namespace dtp::models {
namespace {

// A (dp, tp) mesh wraps the TP plan's DTensor parameters; a model with none
// would get parameters replicated over tp that meet plain activations ("a
// mix of plain at::Tensor and DTensor" at the first op).
void checkTpApplied(const char* api, Llama& model, const DeviceMesh& mesh) {
  const auto& names = mesh.mesh_dim_names();
  if (std::find(names.begin(), names.end(), "tp") == names.end()) return;
  // Already wrapped: fully_shard and replicate name that themselves.
  namespace t = dtp::detail::technique;
  if (!dtp::detail::applied_below(*model, {t::kFullyShard, t::kReplicate}).empty()) return;
  for (const auto& p : model->parameters()) {
    if (is_dtensor(p)) return;
  }
  TORCH_CHECK(false, api, ": the mesh ", mesh.str(), " has a \"tp\" dimension, but no parameter of the model is a "
              "DTensor: the TP plan was not applied. Apply it first (apply_tensor_parallel(model, mesh[\"tp\"]), or "
              "parallelize_llama, which composes TP, AC and data parallelism), or pass the data-parallel dimension "
              "alone (mesh[\"dp\"]).");
}

}  // namespace

void apply_fsdp(Llama& model, const DeviceMesh& mesh, FullyShardOptions options) {
  checkTpApplied("apply_fsdp", model, mesh);
  for (size_t i = 0; i < model->layers->size(); ++i)
    detail::apply_on("apply_fsdp", "layers." + std::to_string(i), [&] { fully_shard(*model->layers[i], mesh, options); });
  detail::apply_on("apply_fsdp", "", [&] { fully_shard(*model, mesh, options); });
}

void apply_ddp(Llama& model, const DeviceMesh& mesh, ReplicateOptions options) {
  checkTpApplied("apply_ddp", model, mesh);
  detail::apply_on("apply_ddp", "", [&] { replicate(*model, mesh, options); });
}

}  // namespace dtp::models
