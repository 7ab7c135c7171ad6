#include "dtp/optim/clip_grad.h"

#include "dtensor/dtensor_impl.h"
#include "dtp/dtensor.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace dtp {
namespace {

std::string rankText(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

std::string dimName(const DTensorSpec& spec, int64_t m) {
  const auto& names = spec.mesh.mesh_dim_names();
  return m < static_cast<int64_t>(names.size()) ? "'" + names[m] + "'" : std::to_string(m);
}

// NOTE: [A pp group that is no pipeline] The pp group's ranks are stages:
// each holds other parameters, so their norms add up over it. A group whose
// ranks already hold the same parameters (the world group with no pipeline,
// a data-parallel or TP group) adds every rank's norm again: replicated
// parameters count once per rank (DDP's on 2 ranks: 2.95 for 2.09). Seen
// from the gradients' meshes, without communication: the pp group shares
// ranks other than this one with a mesh dimension it is not, or it is a
// mesh dimension that shards a gradient (stages never shard one parameter
// between them). Plain gradients carry no mesh: the all-reduce over pp tells
// whether every rank's norm is the same (below).
void checkPpIsAPipeline(const ProcessGroup& pp, const DTensorSpec& spec) {
  const std::vector<int>& pr = pp.global_ranks();
  for (int64_t m = 0; m < spec.mesh.ndim(); ++m) {
    const ProcessGroup g = spec.mesh.get_group(m);
    if (!g.valid()) continue;
    const std::vector<int>& gr = g.global_ranks();
    const std::string fix = ". Pass the pp group of a pipeline (mesh.get_group(\"pp\"), a mesh dimension distinct "
                            "from the ones the parameters are sharded or replicated over), or no pp group when there "
                            "is no pipeline.";
    if (gr == pr) {
      TORCH_CHECK(!spec.placements[m].is_shard(), "clip_grad_norm_: the pp group (global ranks ", rankText(pr),
                  ") is mesh dimension ", dimName(spec, m), " of ", spec.mesh.str(), ", over which a gradient is "
                  "sharded (", spec.str(), "): got a group whose ranks split one parameter, expected pipeline "
                  "stages, which each hold their own parameters", fix);
      continue;
    }
    std::vector<int> shared;
    for (int r : gr)
      if (r != g.global_ranks()[g.rank()] && std::find(pr.begin(), pr.end(), r) != pr.end()) shared.push_back(r);
    TORCH_CHECK(shared.empty(), "clip_grad_norm_: the pp group (global ranks ", rankText(pr), ") is not a pipeline "
                "dimension: it shares global rank", shared.size() == 1 ? " " : "s ", rankText(shared), " with mesh "
                "dimension ", dimName(spec, m), " of ", spec.mesh.str(), " (global ranks ", rankText(gr), "), over "
                "which a gradient (", spec.str(), ") is already combined, so those ranks' norms would count twice",
                fix);
  }
}

// The pp groups whose ranks' norms were compared on this thread (rank).
std::vector<std::vector<int>>& checkedPpGroups() {
  thread_local std::vector<std::vector<int>> checked;
  return checked;
}

}  // namespace

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
    if (pp && pp->valid() && pp->size() > 1) checkPpIsAPipeline(*pp, spec);  // NOTE: [A pp group that is no pipeline]
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
  if (pp && pp->valid() && pp->size() > 1 && pp_in_groups == nullptr) {
    // Other stages. NOTE: [A pp group that is no pipeline]: with plain
    // gradients only the norms tell stages from replicas. The same all-reduce
    // carries what shows whether every rank's norm is the same (sum: their
    // squares too; max: the minimum too), read on the host once per pp group
    // (the one synchronisation, at the first call): stages with equal, non-
    // zero norms do not happen, replicas always have them.
    const at::Tensor stacked = inf ? at::stack({total, -total}) : at::stack({total, total * total});
    pp->all_reduce(stacked, inf ? ReduceOp::Max : ReduceOp::Sum);
    auto& checked = checkedPpGroups();
    if (std::find(checked.begin(), checked.end(), pp->global_ranks()) == checked.end()) {
      const at::Tensor host = stacked.cpu();
      const double a = host[0].item<double>(), b = host[1].item<double>(), n = pp->size();
      const bool zero = a == 0;
      const bool same = inf ? a == -b : std::abs(n * b - a * a) <= 1e-12 * a * a;
      TORCH_CHECK(zero || !same, "clip_grad_norm_: the pp group (global ranks ", rankText(pp->global_ranks()),
                  ") is not a pipeline: every one of its ranks holds gradients of the same norm (",
                  (inf ? a : std::pow(a / n, 1.0 / norm_type)), " over this rank's parameters), so they are "
                  "replicas (data parallel, or no parallelism), not stages, and adding their norms would count each parameter ",
                  pp->size(), " times. Pass the pp group only under pipeline parallelism (mesh.get_group(\"pp\"), "
                  "each rank a stage with its own parameters); without a pipeline pass none.");
      if (!zero) checked.push_back(pp->global_ranks());
    }
    total = stacked[0];
  }
  at::Tensor norm = inf ? total : total.pow(1.0 / norm_type);
  at::Tensor coef = at::clamp_max(max_norm / (norm + 1e-6), 1.0);
  for (auto& l : locals) l.mul_(coef.to(l.scalar_type()));
  return norm.to(options.dtype().toScalarType());
}

}  // namespace dtp
