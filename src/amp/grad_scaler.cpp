// GradScaler: loss scaling over the ranks that step together.
#include "dtp/amp/grad_scaler.h"

#include "dtensor/dtensor_impl.h"

#include <ATen/ATen.h>

#include <cmath>

namespace dtp {

// NOTE: [Loss scaling over ranks] As torch.amp.GradScaler (and
// ShardedGradScaler, which all-reduces the flag over its process group):
// - scale(loss) is loss * s; backward then gives s * g (in float16 inside
//   the compute copies, where s lifts small gradients above float16's
//   underflow; in float32 in the masters' .grad);
// - unscale_ multiplies each gradient's local values (a DTensor's shard,
//   Partial or not: the product is linear) by 1/s; s is a power of two
//   while the options' factors are, so the product is exact unless it
//   underflows float32;
// - a rank's flag is 1 when any of its local values is inf or NaN; one
//   all-reduce (max) over the group makes every rank's the same, so all
//   skip or all step: the ranks of a (dp, tp) or (pp, ...) job hold
//   different shards, and an inf in one shard would otherwise leave the
//   replicas apart;
// - update(): s * backoff after a flagged step; s * growth after
//   growth_interval clean steps in a row, unless that is inf; the growth
//   tracker counts the clean steps (PyTorch's _amp_update_scale_).
// The scale lives on the host (a double), so step() reads the flag there:
// one synchronisation per step, as PyTorch's step() has.

namespace {

void checkOptions(const GradScalerOptions& o) {
  TORCH_CHECK(std::isfinite(o.init_scale()) && o.init_scale() > 0, "GradScaler: init_scale must be positive and "
              "finite, got ", o.init_scale(), ". The default is 65536 (2^16).");
  TORCH_CHECK(o.growth_factor() > 1.0, "GradScaler: growth_factor must be > 1, got ", o.growth_factor(),
              ". The default is 2.");
  TORCH_CHECK(o.backoff_factor() > 0 && o.backoff_factor() < 1.0, "GradScaler: backoff_factor must be in (0, 1), "
              "got ", o.backoff_factor(), ". The default is 0.5.");
  TORCH_CHECK(o.growth_interval() >= 1, "GradScaler: growth_interval must be >= 1, got ", o.growth_interval(),
              ". The default is 2000.");
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options) : options_(std::move(options)), scale_(options_.init_scale()) {
  checkOptions(options_);
  if (!options_.group() && is_initialized()) options_.group(default_process_group());
}

at::Tensor GradScaler::scale(const at::Tensor& outputs) const {
  if (!options_.enabled()) return outputs;
  TORCH_CHECK(outputs.defined() && at::isFloatingType(outputs.scalar_type()), "GradScaler::scale: expected a "
              "floating-point loss, got ", outputs.defined() ? c10::toString(outputs.scalar_type()) : "an undefined tensor",
              ".");
  return outputs * scale_;
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) return;
  PerOptimizer& state = per_optimizer_[&optimizer];
  // step() unscales first, so this also refuses an unscale_ after step().
  TORCH_CHECK(!state.unscaled, "GradScaler::unscale_: already called on this optimizer since the last update(). "
              "Call it at most once per step, before step() (which unscales when it was not called).");
  const double inv = 1.0 / scale_;
  const auto& groups = optimizer.param_groups();
  c10::Device device = at::kCPU;  // the parameters' (NCCL reduces CUDA tensors)
  for (const auto& group : groups)
    if (!group.params().empty()) {
      device = group.params()[0].device();
      break;
    }
  at::Tensor bad = at::zeros({1}, at::TensorOptions(at::kFloat).device(device));  // this rank's flag
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const auto& params = groups[gi].params();
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& g = params[i].grad();
      if (!g.defined()) continue;
      TORCH_CHECK(g.scalar_type() != at::kHalf, "GradScaler::unscale_: parameter ", i, " of param group ", gi,
                  " has float16 gradients (", g.sizes(), "), which unscaling cannot keep exact. Keep the parameters "
                  "in float32 and compute in float16 through a MixedPrecisionPolicy{at::kHalf, at::kFloat} "
                  "(apply_mixed_precision, or replicate's or fully_shard's mp_policy): gradients land in the "
                  "float32 masters.");
      auto* impl = maybeGetDTensorImpl(g);
      at::Tensor local = impl ? impl->local() : g;
      local.mul_(inv);
      if (local.numel() > 0) bad = at::maximum(bad, at::isfinite(local).all().logical_not().to(at::kFloat).reshape({1}));
    }
  }
  const std::optional<ProcessGroup>& group = options_.group();
  if (group && group->valid() && group->size() > 1) group->all_reduce(bad, ReduceOp::Max).wait();
  state.found_inf = bad.item<float>() > 0;
  state.unscaled = true;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    optimizer.step();
    return true;
  }
  PerOptimizer& state = per_optimizer_[&optimizer];  // a std::map's references outlive insertions
  TORCH_CHECK(!state.stepped, "GradScaler::step: already called on this optimizer since the last update(). Call "
              "update() after each step().");
  if (!state.unscaled) unscale_(optimizer);
  state.stepped = true;
  if (state.found_inf) return false;
  optimizer.step();
  return true;
}

void GradScaler::update(std::optional<double> new_scale) {
  if (!options_.enabled()) return;
  if (new_scale) {
    TORCH_CHECK(std::isfinite(*new_scale) && *new_scale > 0, "GradScaler::update: new_scale must be positive and "
                "finite, got ", *new_scale, ".");
    scale_ = *new_scale;
  } else {
    bool any = false, found = false;
    for (const auto& [opt, state] : per_optimizer_) {
      any = any || state.unscaled;
      found = found || state.found_inf;
    }
    TORCH_CHECK(any, "GradScaler::update: no inf/NaN check was recorded since the last update(). Call step(optimizer) "
                "(or unscale_) first.");
    if (found) {
      scale_ *= options_.backoff_factor();
      growth_tracker_ = 0;
    } else if (++growth_tracker_ == options_.growth_interval()) {
      const double grown = scale_ * options_.growth_factor();
      if (std::isfinite(grown)) scale_ = grown;
      growth_tracker_ = 0;
    }
  }
  per_optimizer_.clear();
}

std::map<std::string, double> GradScaler::state_dict() const {
  if (!options_.enabled()) return {};
  return {{"scale", scale_},
          {"growth_factor", options_.growth_factor()},
          {"backoff_factor", options_.backoff_factor()},
          {"growth_interval", static_cast<double>(options_.growth_interval())},
          {"_growth_tracker", static_cast<double>(growth_tracker_)}};
}

void GradScaler::load_state_dict(const std::map<std::string, double>& state) {
  if (!options_.enabled()) return;  // as PyTorch's
  TORCH_CHECK(!state.empty(), "GradScaler::load_state_dict: the state is empty (saved from a disabled scaler). Load "
              "it into a disabled scaler, or leave the load out.");
  for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})
    TORCH_CHECK(state.count(key), "GradScaler::load_state_dict: the state has no '", key, "'; it was not saved by "
                "GradScaler::state_dict.");
  GradScalerOptions o = options_;
  o.init_scale(state.at("scale"))
      .growth_factor(state.at("growth_factor"))
      .backoff_factor(state.at("backoff_factor"))
      .growth_interval(static_cast<int64_t>(state.at("growth_interval")));
  checkOptions(o);
  options_ = o;
  scale_ = o.init_scale();
  growth_tracker_ = static_cast<int64_t>(state.at("_growth_tracker"));
}

}  // namespace dtp
