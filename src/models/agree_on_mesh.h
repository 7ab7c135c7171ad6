// NOTE: [Ranks agree on arguments] (src/comm/agree.h) for the model-level
// one-time APIs (generate, load_hf_weights): over every dimension of the
// mesh the model's DTensor parameters live on; nothing for a plain model.
#pragma once

#include "comm/agree.h"
#include "dtp/dtensor.h"

#include <torch/nn/module.h>

#include <string>

namespace dtp::models {

inline void agree_on_mesh(torch::nn::Module& model, const std::string& api, const std::string& argument,
                          const std::string& value) {
  for (const auto& p : model.parameters()) {
    if (!is_dtensor(p)) continue;
    const DeviceMesh& mesh = device_mesh(p);
    for (int64_t d = 0; d < mesh.ndim(); ++d) agree_on_value(mesh.get_group(d), api, argument, value);
    return;
  }
}

}  // namespace dtp::models
