// apply_ac: torchtitan's activation checkpointing of the reference Llama.
#include "dtp/models/llama.h"

namespace dtp::models {

void apply_ac(Llama& model, ACOptions options) {
  TORCH_CHECK(options.every >= 1, "apply_ac: every=", options.every, " must be >= 1 (1: every block).");
  int64_t i = 0;
  for (const auto& layer : *model->layers)
    if (i++ % options.every == 0) checkpoint_wrapper(*layer, options.mode, options.save_ops);
}

}  // namespace dtp::models
