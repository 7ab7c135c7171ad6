#include "nn/applied.h"

#include <ATen/core/grad_mode.h>

namespace dtp::detail {
namespace {

thread_local int recompute_depth = 0;
thread_local int first_pass_depth = 0;

}  // namespace

nn::HookHost& hooks_of(torch::nn::Module& module, const char* api) {
  auto* host = dynamic_cast<nn::HookHost*>(&module);
  TORCH_CHECK(host != nullptr, api, ": ", module.name(),
              " does not run hooks, so dtp cannot act before and after its forward. Declare it with "
              "DTP_MODULE(Name) instead of TORCH_MODULE(Name), or use dtp::nn modules.");
  return *host;
}

std::shared_ptr<void> applied_state(const torch::nn::Module& module, const std::string& technique) {
  auto* host = dynamic_cast<const nn::HookHost*>(&module);
  if (host == nullptr) return nullptr;
  for (const auto& a : host->applied)
    if (a.technique == technique) return a.state;
  return nullptr;
}

bool was_applied(const torch::nn::Module& module, const std::string& technique) {
  return applied_state(module, technique) != nullptr;
}

std::string applied_below(torch::nn::Module& module, const std::vector<std::string>& techniques) {
  for (const auto& t : techniques)
    if (was_applied(module, t)) return t;
  for (const auto& child : module.children()) {
    std::string found = applied_below(*child, techniques);
    if (!found.empty()) return found;
  }
  return "";
}

RecomputeScope::RecomputeScope() { ++recompute_depth; }
RecomputeScope::~RecomputeScope() { --recompute_depth; }
bool in_recompute() { return recompute_depth > 0; }

CheckpointFirstPassScope::CheckpointFirstPassScope() { ++first_pass_depth; }
CheckpointFirstPassScope::~CheckpointFirstPassScope() { --first_pass_depth; }
bool forward_for_backward() { return at::GradMode::is_enabled() || first_pass_depth > 0; }

}  // namespace dtp::detail
