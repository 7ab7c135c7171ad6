// apply_fsdp, apply_ddp: torchtitan's data-parallel wrappings of the reference Llama.
#include "dtp/models/llama.h"

namespace dtp::models {

void apply_fsdp(Llama& model, const DeviceMesh& mesh, FullyShardOptions options) {
  for (const auto& layer : *model->layers) fully_shard(*layer, mesh, options);
  fully_shard(*model, mesh, options);
}

void apply_ddp(Llama& model, const DeviceMesh& mesh, ReplicateOptions options) {
  replicate(*model, mesh, options);
}

}  // namespace dtp::models
