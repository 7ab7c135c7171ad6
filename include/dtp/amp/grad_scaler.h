// GradScaler: loss scaling for float16 compute, as torch.amp.GradScaler,
// over every rank that steps together (PyTorch's ShardedGradScaler too).
//
//   dtp::apply_mixed_precision(*model, {at::kHalf, at::kFloat});  // or FSDP's / DDP's mp_policy
//   dtp::GradScaler scaler;
//   scaler.scale(loss).backward();
//   scaler.unscale_(opt);              // optional: before clip_grad_norm_
//   dtp::clip_grad_norm_(params, 1.0);
//   scaler.step(opt);                  // skipped when a gradient is inf or NaN on any rank
//   scaler.update();
//
// float16's largest value is 65504 and its smallest normal 6.1e-5: small
// gradients vanish unless the loss is multiplied first. scale() multiplies
// it by the scale (a power of two: 2^16 at first); unscale_ divides every
// gradient the optimizer holds by it (exact: a power of two) and checks them
// for inf and NaN; step() steps only when none was found; update() halves
// the scale after a step with one and doubles it after growth_interval
// clean steps in a row. The gradients must be the float32 masters' (a
// MixedPrecisionPolicy keeps them): float16 gradients are an error, as in
// PyTorch. See NOTE: [Loss scaling over ranks] in src/amp/grad_scaler.cpp.
#pragma once

#include "dtp/process_group.h"

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <optional>

namespace dtp {

struct GradScalerOptions {
  TORCH_ARG(double, init_scale) = 65536.0;  // 2^16
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 2000;
  TORCH_ARG(bool, enabled) = true;
  // The ranks that step together, which skip or take each step as one: one
  // all-reduce (max) of the inf/NaN flag per unscale_. Unset: the default
  // (world) group when one is set, else this process alone (as is an
  // invalid group).
  TORCH_ARG(std::optional<ProcessGroup>, group) = std::nullopt;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  // outputs * the scale (a DTensor stays one); `outputs` itself when disabled.
  at::Tensor scale(const at::Tensor& outputs) const;
  // Divides the gradients of `optimizer`'s parameters by the scale, in
  // place (a DTensor's local shard), and records whether any rank of the
  // group has an inf or NaN among them. Once per optimizer and update().
  void unscale_(torch::optim::Optimizer& optimizer);
  // unscale_ (unless called since the last update()), then optimizer.step()
  // unless a gradient was inf or NaN. Returns whether it stepped (PyTorch
  // returns step's value or None).
  bool step(torch::optim::Optimizer& optimizer);
  // The next scale: backed off after an inf or NaN, grown after
  // growth_interval clean steps; or `new_scale`.
  void update(std::optional<double> new_scale = std::nullopt);

  double get_scale() const { return options_.enabled() ? scale_ : 1.0; }
  int64_t growth_tracker() const { return growth_tracker_; }  // clean steps since the last change
  bool is_enabled() const { return options_.enabled(); }
  const GradScalerOptions& options() const { return options_; }

  // What a checkpoint keeps (PyTorch's state_dict: scale, growth_factor,
  // backoff_factor, growth_interval, _growth_tracker).
  std::map<std::string, double> state_dict() const;
  void load_state_dict(const std::map<std::string, double>& state);

 private:
  struct PerOptimizer {
    bool unscaled = false, stepped = false, found_inf = false;
  };
  GradScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  std::map<const torch::optim::Optimizer*, PerOptimizer> per_optimizer_;
};

}  // namespace dtp
