#include "dtp/optim/clip_grad.h"

#include "dtensor/dtensor_impl.h"
#include "dtp/dtensor.h"

#include <ATen/ATen.h>

#include <cmath>

namespace dtp {

// NOTE: [Fused gradient norm] One device computes (sum over all gradient
// elements of |g|^p)^(1/p). Here every rank holds shards: for each
// parameter, the sum over its local shard, divided by how many ranks of each
// reducing group hold the same shard (the groups it is not sharded over),
// goes into one scalar; one all-reduce (sum, or max for INFINITY) per
// distinct group of all the parameters' mesh dimensions then gives every
// rank the total. The clip coefficient stays a tensor: gradients are scaled
// by min(1, max_norm / (norm + 1e-6)) without reading it on the host.
at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm, double norm_type,
                           const std::optional<ProcessGroup>& pp) {
  TORCH_CHECK(norm_type > 0, "clip_grad_norm_: norm_type must be > 0 (or INFINITY), got ", norm_type, ".");
  const bool inf = std::isinf(norm_type);
  std::vector<at::Tensor> locals;
  std::vector<const DTensorSpec*> specs;
  std::vector<ProcessGroup> groups;  // every distinct group, in the parameters' order (the same on every rank)
  for (const auto& p : params) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    auto* gi = maybeGetDTensorImpl(g);
    if (gi == nullptr) {
      locals.push_back(g);
      specs.push_back(nullptr);
      continue;
    }
    const DTensorSpec& spec = gi->spec();
    TORCH_CHECK(!spec.has_partial(), "clip_grad_norm_: a gradient is Partial (", spec.str(), "): its values are not "
                "the gradient until reduced. Give the parameter its placements' gradients (keep_grad_placements, "
                "which distribute_tensor and the styles set up), or redistribute the gradient first.");
    locals.push_back(gi->local());
    specs.push_back(&spec);
    for (int64_t m = 0; m < spec.mesh.ndim(); ++m) {
      ProcessGroup pg = spec.mesh.get_group(m);
      if (std::find(groups.begin(), groups.end(), pg) == groups.end()) groups.push_back(pg);
    }
  }
  // NOTE: [Parameters every stage holds] A parameter that every pp stage
  // holds is a DTensor on a mesh with the pp dimension (Replicate there):
  // the pp group is then one of `groups`, the parameter's share on each
  // stage is 1/pp of it, and the all-reduce over that group sums the stages.
  // This stage's own parameters (plain, or on meshes without pp) are not
  // replicas over pp: their whole sum goes in. pp is reduced once, whichever
  // way it comes (reducing it as a mesh dim and again as pp counted every
  // parameter pp times).
  const ProcessGroup* pp_in_groups = nullptr;
  if (pp && pp->valid())
    for (const auto& pg : groups)
      if (pg.global_ranks() == pp->global_ranks()) pp_in_groups = &pg;
  const auto options = locals.empty() ? at::TensorOptions(at::kFloat) : locals[0].options();
  at::Tensor total = at::zeros({}, options.dtype(at::kDouble));
  for (size_t i = 0; i < locals.size(); ++i) {
    at::Tensor a = locals[i].abs().to(at::kDouble);
    at::Tensor part = inf ? (a.numel() ? a.max() : at::zeros({}, a.options())) : a.pow(norm_type).sum();
    if (inf) {
      total = at::maximum(total, part);
      continue;
    }
    double replicas = 1;  // ranks of the reducing groups holding this same shard
    for (const auto& pg : groups) {
      bool sharded = false, on_mesh = false;
      if (specs[i] != nullptr)
        for (int64_t m = 0; m < specs[i]->mesh.ndim(); ++m) {
          const bool here = specs[i]->mesh.get_group(m) == pg;
          on_mesh |= here;
          sharded |= here && specs[i]->placements[m].is_shard();
        }
      if (&pg == pp_in_groups && !on_mesh) continue;  // this stage's own
      if (!sharded) replicas *= pg.size();
    }
    total += part / replicas;
  }
  for (const auto& pg : groups) pg.all_reduce(total, inf ? ReduceOp::Max : ReduceOp::Sum);
  if (pp && pp->valid() && pp->size() > 1 && pp_in_groups == nullptr)
    pp->all_reduce(total, inf ? ReduceOp::Max : ReduceOp::Sum);  // other stages
  at::Tensor norm = inf ? total : total.pow(1.0 / norm_type);
  at::Tensor coef = at::clamp_max(max_norm / (norm + 1e-6), 1.0);
  for (auto& l : locals) l.mul_(coef.to(l.scalar_type()));
  return norm.to(options.dtype().toScalarType());
}

}  // namespace dtp
