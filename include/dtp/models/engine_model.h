// The reference Llama (and its families: Mistral, Qwen, MoE) as the serving
// engine's model (dtp/inference/model.h), on one device or after
// apply_tensor_parallel_for_inference:
//
//   inference::Engine engine(models::engine_model(model), options, group, &tokenizer);
#pragma once

#include "dtp/inference/model.h"
#include "dtp/models/llama.h"

#include <memory>

namespace dtp::models {

// `model` must outlive the engine (the adapter holds a reference to it).
std::shared_ptr<inference::Model> engine_model(Llama& model);

}  // namespace dtp::models
