// What fully_shard and replicate share: the (dp, tp) mesh and the module's
// parameters with the fields forward reads them from.
#pragma once

#include "dtp/device_mesh.h"
#include "dtp/dtensor_spec.h"
#include "dtp/fsdp/mixed_precision_policy.h"
#include "nn/applied.h"

#include <torch/nn/module.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dtp::detail {

struct DataParallelMesh {
  ProcessGroup dp;                        // where fully_shard shards: "dp", or HSDP's "dp_shard"
  std::optional<ProcessGroup> replicate;  // HSDP's "dp_replicate": replicas of the shards
  ProcessGroup batch;                     // every data-parallel rank: dp, or (dp_replicate, dp_shard)
  std::optional<DeviceMesh> tp;           // mesh["tp"] (or the experts' mesh["ep"]): where parameters are DTensors
  DeviceMesh dp_inside_tp;                // (tp, [dp_replicate,] dp), without the absent: where shards live
};

// Checks `mesh` for `api` ("fully_shard", ...): 1-D; 2-D, dp and tp (or
// ep); HSDP's dp_replicate and dp_shard, with tp or not; or dp_replicate and
// tp. The names as parallel_mesh_dims reads them (NOTE: [Mesh dimension
// names]): ParallelDims' meshes and their slices read alike.
DataParallelMesh data_parallel_mesh(const DeviceMesh& mesh, const char* api);

// A DTensor parameter must live on m.tp: TP is applied to mesh["tp"] of the
// mesh given to `api`.
void check_tp_parameter(const at::Tensor& param, const std::string& fqn, const DataParallelMesh& m, const char* api);

// NOTE: [Partial gradients under data parallelism] A replicated TP parameter
// (a norm weight under SP) gets a Partial(sum) gradient over tp. Summing
// over tp commutes with averaging over dp, so fully_shard and replicate
// reduce the partial pieces over dp as they are, then sum them over tp in
// one all-reduce. Other placements are redistributed to the parameter's.
struct LocalGrad {
  at::Tensor local;
  bool partial = false;  // to be summed over tp after the dp reduction
};
// `grad` (a DTensor when `param_spec` is given) as data parallelism reduces it.
LocalGrad local_grad(const at::Tensor& grad, const DTensorSpec* param_spec);
// One all-reduce (sum) over `tp` of `pieces` flattened together: each
// piece's sum, shaped as it.
std::vector<at::Tensor> sum_over_tp(const std::vector<at::Tensor>& pieces, const ProcessGroup& tp);

// A parameter and every (module, name) field that holds it (tied: several).
struct ParamSite {
  std::string fqn;
  at::Tensor param;
  std::vector<std::pair<torch::nn::Module*, std::string>> fields;
};

// The parameters under `module` in registration order, skipping subtrees
// where `skip` was applied; tied parameters once.
std::vector<ParamSite> collect_params(torch::nn::Module& module, const std::string& skip);

// A MixedPrecisionPolicy as fully_shard, replicate and apply_mixed_precision
// apply it: the dtype a parameter is computed in (param_dtype; a parameter
// that is not floating point keeps its own), the dtype its gradient is
// reduced in (reduce_dtype, else the compute dtype), and the unit's
// floating-point inputs cast to param_dtype under cast_forward_inputs.
c10::ScalarType mp_compute_dtype(const MixedPrecisionPolicy& policy, const at::Tensor& param);
c10::ScalarType mp_reduce_dtype(const MixedPrecisionPolicy& policy, const at::Tensor& param);
void mp_cast_forward_inputs(const MixedPrecisionPolicy& policy, std::vector<at::Tensor>& inputs);
// A parameter's compute copy in `dtype`, without history: a detached alias
// where the dtype is already that, else a cast of its local shard (a DTensor
// keeps its mesh and placements).
at::Tensor mp_compute_copy(const at::Tensor& param, c10::ScalarType dtype);

}  // namespace dtp::detail
