#include "dtp/module_utils.h"

#include "dtp/nn/modules.h"

#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace dtp {
namespace {

// libtorch keeps a module's registry protected and has no replace call; a
// pointer to the protected member, taken through a derived class, reaches it
// without any cast of the module object.
struct RegistryAccess : torch::nn::Module {
  static constexpr auto params = &RegistryAccess::parameters_;
};

// Field setters per module type: configuration shared by all ranks, written
// at start-up, hence behind a mutex rather than per thread.
struct FieldRegistry {
  std::mutex mu;
  std::unordered_map<std::type_index, FieldSetter> setters;
};

template <class Impl>
FieldSetter weightAndBias() {
  return [](torch::nn::Module& m, const std::string& n, const at::Tensor& t) {
    auto& impl = dynamic_cast<Impl&>(m);
    if (n == "weight") impl.weight = t;
    else if (n == "bias") impl.bias = t;
  };
}

FieldRegistry& fields() {
  static FieldRegistry* r = [] {
    auto* reg = new FieldRegistry();
    auto both = [&](std::type_index a, std::type_index b, FieldSetter f) {
      reg->setters[a] = f;
      reg->setters[b] = f;
    };
    both(typeid(torch::nn::LinearImpl), typeid(nn::HookedImpl<torch::nn::LinearImpl>),
         weightAndBias<torch::nn::LinearImpl>());
    both(typeid(torch::nn::LayerNormImpl), typeid(nn::HookedImpl<torch::nn::LayerNormImpl>),
         weightAndBias<torch::nn::LayerNormImpl>());
    FieldSetter weight_only = [](torch::nn::Module& m, const std::string& n, const at::Tensor& t) {
      if (n == "weight") dynamic_cast<torch::nn::EmbeddingImpl&>(m).weight = t;
    };
    both(typeid(torch::nn::EmbeddingImpl), typeid(nn::HookedImpl<torch::nn::EmbeddingImpl>), weight_only);
    FieldSetter rms = [](torch::nn::Module& m, const std::string& n, const at::Tensor& t) {
      if (n == "weight") dynamic_cast<nn::RMSNormImpl&>(m).weight = t;
    };
    both(typeid(nn::RMSNormImpl), typeid(nn::HookedImpl<nn::RMSNormImpl>), rms);
    return reg;
  }();
  return *r;
}

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> unique_named_parameters(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : module.named_parameters()) {
    if (seen.insert(p.value().unsafeGetTensorImpl()).second) out.emplace_back(p.key(), p.value());
  }
  return out;
}

void replace_parameter(torch::nn::Module& module, const std::string& name, const at::Tensor& value) {
  auto& registry = module.*RegistryAccess::params;
  auto* slot = registry.find(name);
  TORCH_CHECK(slot != nullptr, "replace_parameter: module ", module.name(), " has no parameter '",
              name, "'. Its parameters are: ", c10::Join(", ", registry.keys()), ".");
  const bool requires_grad = slot->requires_grad();
  *slot = value;
  if (value.requires_grad() != requires_grad) slot->set_requires_grad(requires_grad);
}

void register_parameter_fields(std::type_index impl_type, FieldSetter setter) {
  auto& r = fields();
  std::lock_guard<std::mutex> lock(r.mu);
  r.setters[impl_type] = std::move(setter);
}

namespace {

FieldSetter fieldSetter(const torch::nn::Module& module, const std::string& name) {
  FieldSetter setter;
  {
    auto& r = fields();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.setters.find(typeid(module));
    if (it != r.setters.end()) setter = it->second;
  }
  TORCH_CHECK(setter, "dtp: cannot swap parameter '", name, "' of a ", module.name(),
              ": dtp does not know which public field of that module type holds it. Call "
              "dtp::register_parameter_fields<", module.name(), ">(...) once at start-up.");
  return setter;
}

}  // namespace

void set_parameter(torch::nn::Module& module, const std::string& name, const at::Tensor& value) {
  FieldSetter setter = fieldSetter(module, name);
  replace_parameter(module, name, value);
  setter(module, name, value);
}

void set_parameter_field(torch::nn::Module& module, const std::string& name, const at::Tensor& value) {
  fieldSetter(module, name)(module, name, value);
}

}  // namespace dtp
