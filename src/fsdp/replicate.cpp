// replicate: DDP-style bucketed gradient averaging over "dp".
#include "dtp/fsdp/replicate.h"

#include "dtensor/dtensor_impl.h"
#include "dtensor/grad_reduction.h"
#include "dtensor/redistribute.h"
#include "dtensor/rules_agree.h"
#include "dtp/dtensor.h"
#include "dtp/module_utils.h"
#include "dtensor/random_state.h"
#include "fsdp/data_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

namespace dtp {
namespace {

using torch::autograd::variable_list;
using detail::ExecInfo;

constexpr const char* kApplied = detail::technique::kReplicate;

// NOTE: [Overlapped bucket reduction]
// Forward reads each parameter through an alias made by the node of its
// bucket, so backward reaches that node once every gradient of the bucket
// exists. The node then
// - copies the gradients (this rank's shards; a Partial over tp as it is)
//   into one flat tensor `sent` and starts an all-reduce (average over dp)
//   of a copy, without waiting;
// - hands autograd views of `sent`, labelled with the parameters'
//   placements, which AccumulateGrad adopts as .grad or adds to it; hooks on
//   the parameters see these unreduced gradients, as with DDP;
// - at the end of backward (one engine callback per backward) the bucket's
//   all-reduce is waited for, its Partial pieces are summed over tp (one
//   all-reduce per bucket that has any), and `sent` takes the result in
//   place, which corrects .grad where AccumulateGrad adopted the view; where
//   it added the view into an existing .grad (or into a copy), the
//   difference is added to .grad.
// The all-reduces thus run while backward computes the earlier layers.
// Under ReplicateOptions::mp_policy the aliases are casts to param_dtype
// (NOTE: [Compute copies] in src/amp/mixed_precision.cpp does the same
// without data parallelism): `sent` is in the masters' dtype (what
// AccumulateGrad adopts), and a copy of it in reduce_dtype is all-reduced
// and summed over tp, then cast back into `sent`.
// Averaging over dp and summing over tp commute, so the order is free.
// Under activation checkpointing, a block's recomputation runs a nested
// backward (NOTE: [Checkpoint]): the bucket's node runs in it for that
// block's gradients (the others are zeros) and its callback finishes them
// at the end of that nested backward. Sums being linear, the gradients are
// the same; a bucket spanning n checkpointed blocks and the rest is
// all-reduced 1 + n times.

struct Bucket {
  std::vector<size_t> params;  // indexes into State::params
  std::vector<std::string> fqns;
};

struct InFlight {
  size_t bucket;
  at::Tensor sent;     // flat, in the masters' dtype
  at::Tensor reduced;  // flat, in reduce_dtype: all-reduced
  Work work;
  std::vector<at::Tensor> locals;  // views of `sent`, one per parameter
  std::vector<int64_t> offsets;    // where each starts in `sent`
  std::vector<bool> partial;       // summed over tp at the end
  std::vector<bool> accumulates;   // AccumulateGrad adds it to .grad in this backward
};

struct Backward {
  const ExecInfo* task;
  std::vector<InFlight> buckets;
};

class State;

struct BucketBackward : torch::autograd::Node {
  std::weak_ptr<State> state;
  size_t bucket = 0;
  std::string name() const override { return "dtp::ReplicateBucketBackward"; }
  variable_list apply(variable_list&& grads) override;
};

class State : public std::enable_shared_from_this<State> {
 public:
  ProcessGroup dp;
  std::optional<DeviceMesh> tp;
  std::optional<double> divide_factor;  // ReplicateOptions::gradient_divide_factor
  MixedPrecisionPolicy mp;              // ReplicateOptions::mp_policy
  bool owns_batch = false;              // this forward set the data-parallel batch
  std::vector<detail::ParamSite> params;
  std::vector<Bucket> buckets;

  // Forward pre-hook: each bucket's aliases, connected to its node.
  void attach() {
    const bool grad = at::GradMode::is_enabled();
    for (size_t b = 0; b < buckets.size(); ++b) {
      std::vector<at::Tensor> inputs, aliases;
      bool needs_grad = false;
      for (size_t i : buckets[b].params) {
        const at::Tensor& p = params[i].param;
        inputs.push_back(p);
        needs_grad = needs_grad || p.requires_grad();
        aliases.push_back(detail::mp_compute_copy(p, computeDtype(p)));
      }
      if ((!grad || !needs_grad) && !mp.param_dtype) aliases = inputs;  // under mp: the copies, with no history
      if (grad && needs_grad) {
        auto node = std::make_shared<BucketBackward>();
        node->state = weak_from_this();
        node->bucket = b;
        node->set_next_edges(torch::autograd::collect_next_edges(inputs));
        torch::autograd::set_history(aliases, node);
      }
      for (size_t k = 0; k < aliases.size(); ++k)
        for (auto& [module, field] : params[buckets[b].params[k]].fields) set_parameter_field(*module, field, aliases[k]);
    }
  }

  variable_list start(size_t b, variable_list& grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "replicate: backward with create_graph=true is NYI (the averaged "
                "gradient would not be differentiable). Use create_graph=false.");
    const ExecInfo* task = torch::autograd::get_current_graph_task_exec_info();
    TORCH_INTERNAL_ASSERT(task != nullptr, "replicate: bucket backward outside a backward");
    if (!running_ || running_->task != task) {
      running_ = std::make_shared<Backward>(Backward{task, {}});
      torch::autograd::Engine::get_default_engine().queue_callback(
          [self = shared_from_this(), run = running_] { self->finish(*run); });
    }
    InFlight f;
    f.bucket = b;
    std::vector<at::Tensor> flat;
    std::vector<SpecPtr> specs;
    for (size_t k = 0; k < grads.size(); ++k) {
      const at::Tensor& p = params[buckets[b].params[k]].param;
      auto* pi = maybeGetDTensorImpl(p);
      detail::LocalGrad lg;
      if (grads[k].defined()) lg = detail::local_grad(grads[k], pi ? &pi->spec() : nullptr);
      else lg.local = at::zeros((pi ? pi->local() : p).sizes(), (pi ? pi->local() : p).options().dtype(computeDtype(p)));
      const at::Tensor& local = lg.local;
      f.partial.push_back(lg.partial);
      f.accumulates.push_back(detail::accumulates_grad(*task, p));
      flat.push_back(local.reshape({-1}));
      specs.push_back(pi ? pi->spec_ptr() : nullptr);
    }
    const at::Tensor first = params[buckets[b].params[0]].param;  // a bucket has one dtype (makeBuckets)
    const at::Tensor grads_flat = at::cat(flat);
    f.sent = grads_flat.to(first.scalar_type());
    f.reduced = grads_flat.to(reduceDtype(first), /*non_blocking=*/false, /*copy=*/true);
    f.work = dp.all_reduce(f.reduced, divide_factor ? ReduceOp::Sum : ReduceOp::Avg, /*async_op=*/true);
    variable_list out;
    int64_t offset = 0;
    for (size_t k = 0; k < grads.size(); ++k) {
      const at::Tensor& p = params[buckets[b].params[k]].param;
      auto* pi = maybeGetDTensorImpl(p);
      const auto sizes = (pi ? pi->local() : p).sizes();
      f.offsets.push_back(offset);
      at::Tensor view = f.sent.narrow(0, offset, flat[k].numel()).view(sizes);
      offset += flat[k].numel();
      f.locals.push_back(view);
      out.push_back(specs[k] ? makeDTensor(view, specs[k]->dtype == view.scalar_type()
                                                     ? specs[k]
                                                     : make_spec(specs[k]->mesh, specs[k]->placements,
                                                                 specs[k]->shape, view.scalar_type()))
                             : view);
    }
    running_->buckets.push_back(std::move(f));
    return out;
  }

 private:
  // Mixed precision: what forward computes in and what the all-reduce sums in.
  c10::ScalarType computeDtype(const at::Tensor& p) const { return detail::mp_compute_dtype(mp, p); }
  c10::ScalarType reduceDtype(const at::Tensor& p) const { return detail::mp_reduce_dtype(mp, p); }

  void finish(Backward& run) {
    at::NoGradGuard no_grad;
    for (InFlight& f : run.buckets) {
      at::Tensor reduced = f.work.wait();
      if (divide_factor) reduced.div_(*divide_factor);
      std::vector<at::Tensor> sums;
      for (size_t k = 0; k < f.locals.size(); ++k)
        if (f.partial[k]) sums.push_back(reduced.narrow(0, f.offsets[k], f.locals[k].numel()));
      if (!sums.empty()) {
        const std::vector<at::Tensor> summed = detail::sum_over_tp(sums, tp->get_group(0));
        for (size_t k = 0; k < sums.size(); ++k) sums[k].copy_(summed[k]);
      }
      reduced = reduced.to(f.sent.scalar_type());
      at::Tensor delta = reduced - f.sent;
      f.sent.copy_(reduced);
      for (size_t k = 0; k < f.locals.size(); ++k) {
        if (!f.accumulates[k]) continue;
        const at::Tensor grad = params[buckets[f.bucket].params[k]].param.grad();
        if (!grad.defined()) continue;
        auto* gi = maybeGetDTensorImpl(grad);
        at::Tensor g = gi ? gi->local() : grad;
        if (!g.is_alias_of(f.sent))
          g.add_(delta.narrow(0, f.offsets[k], f.locals[k].numel()).view(f.locals[k].sizes()));
      }
    }
    if (running_.get() == &run) running_.reset();
  }

  std::shared_ptr<Backward> running_;
};

variable_list BucketBackward::apply(variable_list&& grads) {
  auto s = state.lock();
  TORCH_CHECK(s != nullptr, "replicate: backward through a module that was destroyed.");
  return s->start(bucket, grads);
}

// DDP's buckets: parameters in reverse order, a new bucket when the cap
// would be passed or the dtype changes.
std::vector<Bucket> makeBuckets(const std::vector<detail::ParamSite>& params, double cap_mb) {
  std::vector<Bucket> out;
  const double cap = cap_mb * 1024 * 1024;
  double bytes = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  for (size_t n = params.size(); n-- > 0;) {
    const at::Tensor& p = params[n].param;
    if (!p.requires_grad()) continue;
    const at::Tensor local = is_dtensor(p) ? to_local(p.detach()) : p;
    const double b = static_cast<double>(local.numel() * local.element_size());
    if (out.empty() || p.scalar_type() != dtype || (bytes > 0 && bytes + b > cap)) {
      out.emplace_back();
      bytes = 0;
      dtype = p.scalar_type();
    }
    out.back().params.push_back(n);
    out.back().fqns.push_back(params[n].fqn);
    bytes += b;
  }
  return out;
}

}  // namespace

void replicate(torch::nn::Module& module, const DeviceMesh& mesh, ReplicateOptions options) {
  nn::HookHost& host = detail::hooks_of(module, kApplied);
  // A replicate()d module inside keeps its parameters (as fully_shard's
  // units): expert parallelism replicates the experts over "dp" apart.
  TORCH_CHECK(!detail::was_applied(module, kApplied), "replicate: ", module.name(), " is under replicate() already. "
              "Call it once per module.");
  TORCH_CHECK(detail::applied_below(module, {detail::technique::kFullyShard}).empty(), "replicate: ", module.name(),
              " (or a module inside it) is already under fully_shard(). Use one data-parallel technique per module.");
  TORCH_CHECK(detail::applied_below(module, {detail::technique::kMixedPrecision}).empty(), "replicate: ", module.name(),
              " (or a module inside it) has apply_mixed_precision, whose copies replicate's gradient buckets would "
              "not see. Pass the policy as ReplicateOptions::mp_policy instead.");
  for (const auto& dtype : {options.mp_policy.param_dtype, options.mp_policy.reduce_dtype})
    TORCH_CHECK(!dtype || at::isFloatingType(*dtype), "replicate: mp_policy for ", module.name(), ": got dtype ",
                *dtype, ", expected a floating-point dtype (at::kBFloat16, at::kHalf, at::kFloat).");
  TORCH_CHECK(options.bucket_cap_mb > 0, "replicate: bucket_cap_mb must be > 0, got ", options.bucket_cap_mb, ".");
  const auto m = detail::data_parallel_mesh(mesh, kApplied);
  check_sharding_rules_agree(mesh, kApplied);  // NOTE: [Ranks agree on sharding rules]
  auto state = std::make_shared<State>();
  state->dp = m.batch;  // every data-parallel rank (HSDP's two dimensions as one)
  state->tp = m.tp;
  state->divide_factor = options.gradient_divide_factor;
  state->mp = options.mp_policy;
  state->params = detail::collect_params(module, kApplied);
  for (const auto& site : state->params) {
    if (is_dtensor(site.param)) detail::check_tp_parameter(site.param, site.fqn, m, kApplied);
    TORCH_CHECK(!site.param.is_meta(), "replicate: parameter ", site.fqn, " is on the meta device (deferred init). "
                "Apply tensor parallelism first (each rank gets its shard) or initialize the weights before replicate.");
  }
  for (const auto& site : state->params)
    for (const auto& [owner, name] : site.fields) set_parameter_field(*owner, name, site.param);  // validates
  state->buckets = makeBuckets(state->params, options.bucket_cap_mb);
  host.pre_hooks.push_back([state](std::vector<at::Tensor>& inputs) {
    // NOTE: [Random ops under data parallelism]; the outermost replicate's.
    state->owns_batch = !detail::data_parallel_batch().valid();
    if (state->owns_batch) detail::set_data_parallel_batch(state->dp);
    state->attach();
    detail::mp_cast_forward_inputs(state->mp, inputs);
  });
  host.post_hooks.push_back([state](nn::Slots&) {
    if (state->owns_batch) detail::set_data_parallel_batch(ProcessGroup());
  });
  host.applied.push_back({kApplied, state});
}

std::vector<std::vector<std::string>> replicate_buckets(const torch::nn::Module& module) {
  auto state = std::static_pointer_cast<State>(detail::applied_state(module, kApplied));
  TORCH_CHECK(state != nullptr, "replicate_buckets: ", module.name(), " is not under replicate().");
  std::vector<std::vector<std::string>> out;
  for (const auto& b : state->buckets) out.push_back(b.fqns);
  return out;
}

}  // namespace dtp
