// The MoE layers of a model, in block order (none for a dense model).
#pragma once

#include "dtp/models/llama.h"

#include <vector>

namespace dtp::models::detail {

std::vector<MoEImpl*> moe_layers(Llama& model);

}  // namespace dtp::models::detail
