// What fully_shard and replicate share: the (dp, tp) mesh, the module's
// parameters with the fields forward reads them from, and the record of
// which technique was applied to a module.
#pragma once

#include "dtp/device_mesh.h"
#include "dtp/nn/hooked.h"

#include <torch/nn/module.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dtp::detail {

struct DataParallelMesh {
  ProcessGroup dp;
  std::optional<DeviceMesh> tp;  // mesh["tp"] of a 2-D mesh
  DeviceMesh dp_inside_tp;       // (tp, dp), or dp alone: where fully_shard's shards live
};

// Checks `mesh` for `api` ("fully_shard", ...): 1-D, or 2-D named dp and tp.
DataParallelMesh data_parallel_mesh(const DeviceMesh& mesh, const char* api);

// A DTensor parameter must live on m.tp: TP is applied to mesh["tp"] of the
// mesh given to `api`.
void check_tp_parameter(const at::Tensor& param, const std::string& fqn, const DataParallelMesh& m, const char* api);

// The hooks of `module`; an error naming `api` and the fix when it has none.
nn::HookHost& hooks_of(torch::nn::Module& module, const char* api);

// The state `technique` left on `module` (HookHost::applied), or null.
std::shared_ptr<void> applied_state(const torch::nn::Module& module, const std::string& technique);
bool was_applied(const torch::nn::Module& module, const std::string& technique);
// The first of `techniques` applied to `module` or a descendant, or "".
std::string applied_below(torch::nn::Module& module, const std::vector<std::string>& techniques);

// A parameter and every (module, name) field that holds it (tied: several).
struct ParamSite {
  std::string fqn;
  at::Tensor param;
  std::vector<std::pair<torch::nn::Module*, std::string>> fields;
};

// The parameters under `module` in registration order, skipping subtrees
// where `skip` was applied; tied parameters once.
std::vector<ParamSite> collect_params(torch::nn::Module& module, const std::string& skip);

}  // namespace dtp::detail
