#include "parallel/data_parallel.h"

#include "dtp/dtensor.h"
#include "mesh/select_dims.h"

#include <algorithm>
#include <unordered_map>

namespace dtp::detail {
namespace {

void collect(torch::nn::Module& module, const std::string& prefix, const std::string& skip,
             std::vector<ParamSite>& out, std::unordered_map<const c10::TensorImpl*, size_t>& seen) {
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    auto it = seen.find(item.value().unsafeGetTensorImpl());
    if (it == seen.end()) {
      it = seen.emplace(item.value().unsafeGetTensorImpl(), out.size()).first;
      out.push_back({prefix + item.key(), item.value(), {}});
    }
    out[it->second].fields.emplace_back(&module, item.key());
  }
  for (const auto& child : module.named_children()) {
    if (was_applied(*child.value(), skip)) continue;
    collect(*child.value(), prefix + child.key() + ".", skip, out, seen);
  }
}

}  // namespace

DataParallelMesh data_parallel_mesh(const DeviceMesh& mesh, const char* api) {
  TORCH_CHECK(mesh.valid(), api, ": invalid DeviceMesh. Build one with init_device_mesh.");
  if (mesh.ndim() == 1) return {mesh.get_group(0), std::nullopt, mesh};
  const auto& names = mesh.mesh_dim_names();
  const bool named = names.size() == 2 && std::find(names.begin(), names.end(), "dp") != names.end() &&
                     std::find(names.begin(), names.end(), "tp") != names.end();
  TORCH_CHECK(named, api, ": ", mesh.str(),
              " is not a data-parallel mesh. Pass a 1-D mesh, or a 2-D mesh with dimensions named \"dp\" and "
              "\"tp\": init_device_mesh(\"cpu\", {dp, tp}, {\"dp\", \"tp\"}). (HSDP meshes are NYI.)");
  return {mesh.get_group("dp"), mesh["tp"],
          select_mesh_dims(mesh, {mesh.dim_index("tp"), mesh.dim_index("dp")})};
}

void check_tp_parameter(const at::Tensor& param, const std::string& fqn, const DataParallelMesh& m, const char* api) {
  const auto& spec = dtensor_spec(param);
  TORCH_CHECK(m.tp && spec.mesh == *m.tp, api, ": parameter ", fqn, " is a DTensor on ", spec.mesh.str(),
              ", but the mesh passed has ", m.tp ? "\"tp\" " + m.tp->str() : std::string("no \"tp\" dimension"),
              ". Apply the TP plan to mesh[\"tp\"] of the same (dp, tp) mesh, then call ", api, " with that mesh.");
}

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

std::vector<ParamSite> collect_params(torch::nn::Module& module, const std::string& skip) {
  std::vector<ParamSite> out;
  std::unordered_map<const c10::TensorImpl*, size_t> seen;
  collect(module, "", skip, out, seen);
  return out;
}

}  // namespace dtp::detail
