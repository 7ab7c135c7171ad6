#include "dtp/module_utils.h"

#include <torch/nn/module.h>

namespace dtp {
namespace {

// libtorch keeps a module's registry protected and has no replace call; a
// pointer to the protected member, taken through a derived class, reaches it
// without any cast of the module object.
struct RegistryAccess : torch::nn::Module {
  static constexpr auto params = &RegistryAccess::parameters_;
};

}  // namespace

void replace_parameter(torch::nn::Module& module, const std::string& name, const at::Tensor& value) {
  auto& registry = module.*RegistryAccess::params;
  auto* slot = registry.find(name);
  TORCH_CHECK(slot != nullptr, "replace_parameter: module ", module.name(), " has no parameter '",
              name, "'. Its parameters are: ", c10::Join(", ", registry.keys()), ".");
  const bool requires_grad = slot->requires_grad();
  *slot = value;
  if (value.requires_grad() != requires_grad) slot->set_requires_grad(requires_grad);
}

}  // namespace dtp
