// The reference Llama cut into pipeline stages (pp/pipeline.h).
#pragma once

#include "dtp/models/llama.h"

#include <vector>

namespace dtp::models {

// Stage `stage` of `stages` of `model`: a Llama holding `model`'s own
// modules (shared, not copied) for layers [first[stage], first[stage+1]),
// the first stage also the token embedding, the last also the final norm
// and the output head; it maps tokens or activations [batch, seq, dim] to
// activations or logits. `first` lists each stage's first layer (a user
// split); empty, the layers are divided evenly, which needs n_layers to be a
// multiple of stages. Tied embeddings (embedding and head on two stages) are
// NYI.
Llama llama_pipeline_stage(const Llama& model, int stage, int stages, std::vector<int64_t> first = {});

}  // namespace dtp::models
