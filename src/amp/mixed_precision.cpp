// apply_mixed_precision: per-forward compute copies of a module's parameters.
#include "dtp/amp/mixed_precision.h"

#include "dtensor/dtensor_impl.h"
#include "dtensor/random_state.h"
#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/module_utils.h"
#include "fsdp/data_parallel.h"
#include "nn/applied.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

namespace dtp {
namespace {

using torch::autograd::variable_list;

constexpr const char* kApplied = detail::technique::kMixedPrecision;

// NOTE: [Compute copies]
// Before each forward of the module (its pre-hook):
// - every parameter under it (not under a module with a policy of its own),
//   read from the registry then, is cast to param_dtype: a plain tensor
//   whole, a DTensor's local shard, its placements kept:
//   f32[64,32](S(0)) on tp=2 -> bf16[64,32](S(0)), local bf16[32,32];
// - the copies are outputs of one autograd node whose edges are the masters
//   (those that require grad), and the modules' fields point at them, so
//   forward and backward compute in param_dtype. The fields keep the copies
//   until the next forward: checkpoint's recomputation in backward reads
//   them again (NOTE: [Checkpoint]);
// - backward reaches the node once it has every gradient of the copies (or,
//   under checkpoint, in each nested backward with the block's). Gradients
//   leave it in the masters' dtype, so .grad and the optimizer stay float32.
//   A Partial(sum) gradient over tp (a replicated parameter meeting sharded
//   activations) is summed in reduce_dtype: when that is the masters' dtype,
//   by the masters' own end-of-backward buckets (NOTE: [Bucketed gradient
//   reduction]), so collectives are those of a float32 run; otherwise here,
//   in reduce_dtype, one all-reduce per tp group and backward reaching the
//   node.
// replicate and fully_shard make their own copies (their mp_policy), from
// the same policy: this technique refuses to run with them.
struct CastBackward : torch::autograd::Node {
  std::vector<at::Tensor> masters;  // one per output, in order
  MixedPrecisionPolicy policy;
  std::string name() const override { return "dtp::MixedPrecisionCastBackward"; }
  variable_list apply(variable_list&& grads) override;
};

SpecPtr withDtype(const DTensorSpec& spec, c10::ScalarType dtype) {
  return make_spec(spec.mesh, spec.placements, spec.shape, dtype);
}

variable_list CastBackward::apply(variable_list&& grads) {
  TORCH_CHECK(!at::GradMode::is_enabled(), "apply_mixed_precision: backward with create_graph=true is NYI (the "
              "cast of the gradients to the masters' dtype is not differentiable here). Use create_graph=false.");
  variable_list out(grads.size());
  struct Sum {  // the Partial gradients of one tp group
    ProcessGroup group;
    std::vector<size_t> which;
    std::vector<at::Tensor> pieces;
  };
  std::vector<Sum> sums;
  for (size_t k = 0; k < grads.size(); ++k) {
    const at::Tensor& g = grads[k];
    if (!g.defined()) continue;
    const at::Tensor& p = masters[k];
    const c10::ScalarType master = p.scalar_type(), reduce = detail::mp_reduce_dtype(policy, p);
    auto* pi = maybeGetDTensorImpl(p);
    if (pi == nullptr) {
      out[k] = g.to(reduce).to(master);
      continue;
    }
    auto* gi = maybeGetDTensorImpl(g);
    TORCH_INTERNAL_ASSERT(gi != nullptr, "apply_mixed_precision: the gradient of a DTensor parameter is a plain tensor");
    if (reduce == master) {  // the master's buckets sum it (keep_grad_placements)
      out[k] = makeDTensor(gi->local().to(master), withDtype(gi->spec(), master));
      continue;
    }
    const detail::LocalGrad lg = detail::local_grad(g, &pi->spec());
    if (!lg.partial) {
      out[k] = makeDTensor(lg.local.to(reduce).to(master), pi->spec_ptr());
      continue;
    }
    const ProcessGroup group = pi->spec().mesh.get_group(0);
    auto it = std::find_if(sums.begin(), sums.end(), [&](const Sum& s) { return s.group == group; });
    if (it == sums.end()) it = sums.insert(sums.end(), Sum{group, {}, {}});
    it->which.push_back(k);
    it->pieces.push_back(lg.local.to(reduce));
  }
  // CommCounter files these as the gradient buckets' are.
  static const std::string kLabel = "(gradient reduction)";
  const CommModuleScope scope(&kLabel);
  for (const Sum& s : sums) {
    const std::vector<at::Tensor> summed = detail::sum_over_tp(s.pieces, s.group);
    for (size_t i = 0; i < s.which.size(); ++i) {
      const at::Tensor& p = masters[s.which[i]];
      out[s.which[i]] = makeDTensor(summed[i].to(p.scalar_type()), unsafeGetDTensorImpl(p)->spec_ptr());
    }
  }
  return out;
}

// The pre-hook: NOTE: [Compute copies].
void castForForward(torch::nn::Module& module, const MixedPrecisionPolicy& policy, std::vector<at::Tensor>& inputs) {
  TORCH_CHECK(!detail::data_parallel_batch().valid(), "apply_mixed_precision: ", module.name(), " runs inside the "
              "forward of a module under replicate() or fully_shard(), which set the parameters forward reads. Pass "
              "the policy as their mp_policy (ReplicateOptions / FullyShardOptions) instead.");
  const std::string dp = detail::applied_below(module, {detail::technique::kFullyShard, detail::technique::kReplicate});
  TORCH_CHECK(dp.empty(), "apply_mixed_precision: a module inside ", module.name(), " is under ", dp, "(), which "
              "sets the parameters forward reads. Pass the policy as its mp_policy (",
              dp == detail::technique::kReplicate ? "ReplicateOptions" : "FullyShardOptions", ") instead.");
  const auto sites = detail::collect_params(module, kApplied);
  std::vector<at::Tensor> copies, masters, connected;
  for (const auto& site : sites) {
    const at::Tensor& p = site.param;
    TORCH_CHECK(!p.is_meta(), "apply_mixed_precision: parameter ", site.fqn, " of ", module.name(), " is on the meta "
                "device (deferred init). Initialize the weights (init_weights) before the first forward.");
    copies.push_back(detail::mp_compute_copy(p, detail::mp_compute_dtype(policy, p)));
    if (p.requires_grad()) {
      masters.push_back(p);
      connected.push_back(copies.back());
    }
  }
  if (at::GradMode::is_enabled() && !masters.empty()) {
    auto node = std::make_shared<CastBackward>();
    node->policy = policy;
    node->set_next_edges(torch::autograd::collect_next_edges(masters));
    node->masters = std::move(masters);
    torch::autograd::set_history(connected, node);
  }
  for (size_t i = 0; i < sites.size(); ++i)
    for (const auto& [owner, field] : sites[i].fields) set_parameter_field(*owner, field, copies[i]);
  detail::mp_cast_forward_inputs(policy, inputs);
}

void checkDtype(const std::optional<c10::ScalarType>& dtype, const char* what, const std::string& name) {
  TORCH_CHECK(!dtype || at::isFloatingType(*dtype), "apply_mixed_precision: ", what, " for ", name, ": got ",
              *dtype, ", expected a floating-point dtype (at::kBFloat16, at::kHalf, at::kFloat).");
}

}  // namespace

bool has_mixed_precision(const torch::nn::Module& module) { return detail::was_applied(module, kApplied); }

void apply_mixed_precision(torch::nn::Module& module, MixedPrecisionPolicy policy) {
  nn::HookHost& host = detail::hooks_of(module, kApplied);
  TORCH_CHECK(!has_mixed_precision(module), "apply_mixed_precision: ", module.name(), " has a mixed-precision "
              "policy already. Apply it once per module.");
  const std::string dp = detail::applied_below(module, {detail::technique::kFullyShard, detail::technique::kReplicate});
  TORCH_CHECK(dp.empty(), "apply_mixed_precision: ", module.name(), " (or a module inside it) is under ", dp, "(), "
              "which sets the parameters forward reads. Pass the policy as its mp_policy (",
              dp == detail::technique::kReplicate ? "ReplicateOptions" : "FullyShardOptions", ") instead.");
  checkDtype(policy.param_dtype, "param_dtype", module.name());
  checkDtype(policy.reduce_dtype, "reduce_dtype", module.name());
  // Every field must be one set_parameter_field knows, before any forward.
  for (const auto& site : detail::collect_params(module, kApplied))
    for (const auto& [owner, field] : site.fields) set_parameter_field(*owner, field, site.param);
  torch::nn::Module* self = &module;
  host.pre_hooks.push_back([self, policy](std::vector<at::Tensor>& inputs) { castForForward(*self, policy, inputs); });
  host.applied.push_back({kApplied, std::make_shared<MixedPrecisionPolicy>(policy)});
}

}  // namespace dtp
