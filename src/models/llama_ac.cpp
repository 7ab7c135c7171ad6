// apply_ac: torchtitan's activation checkpointing of the reference Llama.
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "models/apply_on.h"

namespace dtp::models {

void apply_ac(Llama& model, ACOptions options) {
  TORCH_CHECK(options.every >= 1, "apply_ac: every=", options.every, " must be >= 1 (1: every block).");
  for (size_t i = 0; i < model->layers->size(); ++i) {
    if (static_cast<int64_t>(i) % options.every != 0) continue;
    detail::apply_on("apply_ac", "layers." + std::to_string(i),
                     [&] { checkpoint_wrapper(*model->layers[i], options.mode, options.save_ops); });
  }
}

}  // namespace dtp::models
