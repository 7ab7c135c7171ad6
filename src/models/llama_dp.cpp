// apply_fsdp, apply_ddp: torchtitan's data-parallel wrappings of the reference Llama.
#include "dtp/models/llama.h"
#include "models/apply_on.h"

namespace dtp::models {

void apply_fsdp(Llama& model, const DeviceMesh& mesh, FullyShardOptions options) {
  for (size_t i = 0; i < model->layers->size(); ++i)
    detail::apply_on("apply_fsdp", "layers." + std::to_string(i), [&] { fully_shard(*model->layers[i], mesh, options); });
  detail::apply_on("apply_fsdp", "", [&] { fully_shard(*model, mesh, options); });
}

void apply_ddp(Llama& model, const DeviceMesh& mesh, ReplicateOptions options) {
  detail::apply_on("apply_ddp", "", [&] { replicate(*model, mesh, options); });
}

}  // namespace dtp::models
