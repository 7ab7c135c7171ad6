// Swapping a torch::nn::Module's parameters for DTensor parameters in place.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <typeindex>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}

namespace dtp {

// The module's parameters by FQN, each tensor once: a tied weight keeps its
// first name (optimizers and checkpoints must not see it twice).
std::vector<std::pair<std::string, at::Tensor>> unique_named_parameters(const torch::nn::Module& module);

// Replaces the module's own parameter `name` (not a child's: no dots) in its
// registry only, keeping its position and requires_grad.
void replace_parameter(torch::nn::Module& module, const std::string& name, const at::Tensor& value);

// Replaces the parameter in the registry *and* in the module's public field
// (Linear::weight...), which is a separate handle that forward() reads. Knows
// the stock modules (Linear, Embedding, LayerNorm, RMSNorm); other module types
// need register_parameter_fields, else this fails naming the type.
void set_parameter(torch::nn::Module& module, const std::string& name, const at::Tensor& value);

// Sets the public field only; the registry keeps what it holds (fully_shard:
// the registry holds the sharded parameter, forward reads the gathered one).
void set_parameter_field(torch::nn::Module& module, const std::string& name, const at::Tensor& value);

using FieldSetter = std::function<void(torch::nn::Module&, const std::string&, const at::Tensor&)>;
void register_parameter_fields(std::type_index impl_type, FieldSetter setter);

// Teaches set_parameter the fields of a user module:
//   dtp::register_parameter_fields<MyImpl>([](MyImpl& m, const std::string& n, const at::Tensor& t) {
//     if (n == "w") m.w = t; });
template <class Impl>
void register_parameter_fields(std::function<void(Impl&, const std::string&, const at::Tensor&)> f) {
  register_parameter_fields(typeid(Impl), [f](torch::nn::Module& m, const std::string& n,
                                              const at::Tensor& t) { f(dynamic_cast<Impl&>(m), n, t); });
}

}  // namespace dtp
