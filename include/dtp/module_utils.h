// Swapping a torch::nn::Module's parameters for DTensor parameters in place.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace torch::nn {
class Module;
}

namespace dtp {

// Replaces the module's own parameter `name` (not a child's: no dots) in its
// registry, keeping its position and requires_grad. The module's public field
// (e.g. Linear's `weight`) is a separate handle: callers update it too.
void replace_parameter(torch::nn::Module& module, const std::string& name, const at::Tensor& value);

}  // namespace dtp
