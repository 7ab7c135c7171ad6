// clip_grad_norm_: torch::nn::utils::clip_grad_norm_ for DTensor parameters.
#pragma once

#include "dtp/process_group.h"

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace dtp {

// Scales the gradients of `params` in place so that their total norm (of
// type norm_type: 2, 1, any p > 0, or INFINITY) is at most max_norm, as
// libtorch's clip_grad_norm_ does on one device, and returns the total norm
// before clipping as a 0-dim tensor (reading it, e.g. .item(), is the only
// host synchronisation). The norm is one fused reduction: each parameter's
// shard contributes its sum of |g|^p (max for INFINITY) to one scalar, which
// is all-reduced once per distinct process group of the parameters' meshes
// (a parameter replicated over a group contributes its share, 1/size), not
// once per parameter. See NOTE: [Fused gradient norm].
// Under pipeline parallelism each pp rank holds other parameters: pass the
// pp group (mesh.get_group("pp")) and their norms combine over it (one more
// all-reduce), as torchtitan's clip_grad_norm_ does with its pp mesh. Each
// parameter passed with `pp` must be held by one pp rank only (its stage's):
// a parameter every stage holds (a model not split into stages) would count
// once per stage. Pass such parameters without `pp`. (Not detected: ranks
// cannot tell a replica from another stage's tensor of the same shape.)
at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm, double norm_type = 2.0,
                           const std::optional<ProcessGroup>& pp = std::nullopt);

}  // namespace dtp
