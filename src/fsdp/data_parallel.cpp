#include "fsdp/data_parallel.h"

#include "dtensor/dtensor_impl.h"
#include "dtensor/redistribute.h"
#include "dtp/dtensor.h"
#include "dtp/parallel_dims.h"
#include "mesh/flatten.h"
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
  if (mesh.ndim() == 1) return {mesh.get_group(0), std::nullopt, mesh.get_group(0), std::nullopt, mesh};
  // The names are read once, by parallel_mesh_dims (NOTE: [Mesh dimension names]).
  const ParallelMeshDims d = parallel_mesh_dims(mesh);
  if (d.cp) {
    // NOTE: [Data parallelism over cp] Under context parallelism every cp
    // rank holds the whole model and computes gradients from its positions
    // of the same sequences: the parameters are replicated over cp and their
    // gradients must be summed over cp as over dp. As torchtitan does, the
    // data-parallel dimension is then dp_shard x cp, flattened as
    // "dp_shard_cp" (the ranks that differ only in those), and FSDP shards
    // (or DDP averages) over it: on (dp=2, cp=2, tp=2), mesh[{"dp", "cp"}]
    // flattened and root[{"dp_shard_cp", "tp"}] in place of the mesh given.
    // The average over dp x cp is the mean over the batch because each cp
    // rank's loss is weighted by its share of the positions (NOTE:
    // [Context-parallel loss] in src/models/llama_cp.cpp). With cp alone
    // (no dp) this is still the clean way: the sum over cp is a gradient
    // reduction like dp's, and FSDP or DDP over cp does it with their
    // buckets, their overlap and their mixed precision, where a hook of its
    // own would be a second reducer.
    std::vector<std::string> shard, names;
    if (d.dp_shard) shard.push_back(*d.dp_shard);
    shard.push_back(*d.cp);
    (void)mesh[shard].flatten("dp_shard_cp");  // collective the first time; the same group afterwards
    for (const auto& name : mesh.mesh_dim_names()) {
      if (name == *d.cp) names.emplace_back("dp_shard_cp");
      else if (!d.dp_shard || name != *d.dp_shard) names.push_back(name);
    }
    return data_parallel_mesh(mesh.get_root_mesh()[names], api);
  }
  const size_t n = mesh.mesh_dim_names().size();
  // The second dimension of a 2-D mesh is where the parameters are DTensors
  // already: "tp" (the TP plan), or "ep" (the experts, by expert parallelism).
  const bool two_d = n == 2 && d.dp_shard && !d.dp_replicate && (d.tp || d.ep);
  const bool hsdp = (n == 2 || (n == 3 && d.tp)) && d.dp_replicate && d.dp_shard;
  // DDP alone (ParallelDims' (dp_replicate, tp)): the one data-parallel dimension.
  const bool replicate_tp = n == 2 && d.dp_replicate && d.tp;
  TORCH_CHECK(two_d || hsdp || replicate_tp, api, ": ", mesh.str(), " is not a data-parallel mesh. Pass a 1-D mesh, "
              "a 2-D mesh with dimensions named \"dp\" and \"tp\" (init_device_mesh(\"cpu\", {dp, tp}, {\"dp\", \"tp\"})) or "
              "\"dp\" and \"ep\" (for the experts), or for HSDP one named \"dp_replicate\" and \"dp_shard\", with \"tp\" "
              "or not (ParallelDims::build_mesh's names read alike: NOTE: [Mesh dimension names]).");
  if (two_d || replicate_tp) {
    const std::string& outer = two_d ? *d.dp_shard : *d.dp_replicate;
    const std::string& inner = d.tp ? *d.tp : *d.ep;
    const ProcessGroup dp = mesh.get_group(outer);
    return {dp, std::nullopt, dp, mesh[inner], select_mesh_dims(mesh, {mesh.dim_index(inner), mesh.dim_index(outer)})};
  }
  const std::optional<DeviceMesh> tp = d.tp ? std::optional<DeviceMesh>(mesh[*d.tp]) : std::nullopt;
  const int64_t r = mesh.dim_index(*d.dp_replicate), s = mesh.dim_index(*d.dp_shard);
  std::vector<int64_t> inside = {r, s};
  if (tp) inside.insert(inside.begin(), mesh.dim_index(*d.tp));
  return {mesh.get_group(s), mesh.get_group(r), flattened_group(mesh, {r, s}, api), tp, select_mesh_dims(mesh, inside)};
}

void check_tp_parameter(const at::Tensor& param, const std::string& fqn, const DataParallelMesh& m, const char* api) {
  const auto& spec = dtensor_spec(param);
  TORCH_CHECK(m.tp && spec.mesh == *m.tp, api, ": parameter ", fqn, " is a DTensor on ", spec.mesh.str(),
              ", but the mesh passed has ", m.tp ? "\"tp\" " + m.tp->str() : std::string("no \"tp\" dimension"),
              ". Apply the TP plan to mesh[\"tp\"] of the same (dp, tp) mesh, then call ", api, " with that mesh.");
}

LocalGrad local_grad(const at::Tensor& grad, const DTensorSpec* param_spec) {
  if (param_spec == nullptr) return {grad, false};
  auto* gi = maybeGetDTensorImpl(grad);
  TORCH_INTERNAL_ASSERT(gi != nullptr, "data parallelism: the gradient of a DTensor parameter is not a DTensor");
  const Placements& have = gi->spec().placements;
  const Placements& want = param_spec->placements;
  const bool partial = have.size() == 1 && have[0].is_partial() && have[0].op == ReduceOp::Sum && want[0].is_replicate();
  if (have == want || partial) return {gi->local(), partial};
  return {redistribute_local(gi->local(), gi->spec(), want, /*backward=*/true, /*consume=*/false), false};
}

std::vector<at::Tensor> sum_over_tp(const std::vector<at::Tensor>& pieces, const ProcessGroup& tp) {
  std::vector<at::Tensor> flat;
  for (const auto& p : pieces) flat.push_back(p.reshape({-1}));
  at::Tensor summed = tp.all_reduce(at::cat(flat)).wait();
  std::vector<at::Tensor> out;
  int64_t at = 0;
  for (const auto& p : pieces) {
    out.push_back(summed.narrow(0, at, p.numel()).view(p.sizes()));
    at += p.numel();
  }
  return out;
}

std::vector<ParamSite> collect_params(torch::nn::Module& module, const std::string& skip) {
  std::vector<ParamSite> out;
  std::unordered_map<const c10::TensorImpl*, size_t> seen;
  collect(module, "", skip, out, seen);
  return out;
}

c10::ScalarType mp_compute_dtype(const MixedPrecisionPolicy& policy, const at::Tensor& param) {
  return at::isFloatingType(param.scalar_type()) ? policy.param_dtype.value_or(param.scalar_type())
                                                 : param.scalar_type();
}

c10::ScalarType mp_reduce_dtype(const MixedPrecisionPolicy& policy, const at::Tensor& param) {
  return at::isFloatingType(param.scalar_type()) ? policy.reduce_dtype.value_or(mp_compute_dtype(policy, param))
                                                 : param.scalar_type();
}

void mp_cast_forward_inputs(const MixedPrecisionPolicy& policy, std::vector<at::Tensor>& inputs) {
  const auto dtype = policy.param_dtype;
  if (!dtype || !policy.cast_forward_inputs) return;
  for (auto& x : inputs)
    if (x.defined() && at::isFloatingType(x.scalar_type()) && x.scalar_type() != *dtype) x = x.to(*dtype);
}

at::Tensor mp_compute_copy(const at::Tensor& param, c10::ScalarType dtype) {
  auto* pi = maybeGetDTensorImpl(param);
  const at::Tensor local = pi ? pi->local() : param;
  const at::Tensor copy = local.scalar_type() == dtype ? detached_alias(local) : local.detach().to(dtype);
  if (pi == nullptr) return copy;
  const DTensorSpec& spec = pi->spec();
  return makeDTensor(copy, spec.dtype == dtype ? pi->spec_ptr() : make_spec(spec.mesh, spec.placements, spec.shape, dtype));
}

}  // namespace dtp::detail
