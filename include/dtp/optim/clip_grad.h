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
// all-reduce), as torchtitan's clip_grad_norm_ does with its pp mesh.
// A parameter every stage holds (shared weights) is counted once when it is
// a DTensor on a mesh with the pp dimension, Replicate there (distribute it
// over mesh["pp"] or the whole (pp, ...) mesh): its placement says that the
// stages hold one tensor. Plain tensors, and DTensors on meshes without pp,
// are taken as this stage's own, so a plain copy on every stage would count
// once per stage (ranks cannot tell a copy from another stage's tensor of
// the same shape without comparing values). See NOTE: [Parameters every
// stage holds] in src/optim/clip_grad.cpp.
// A pp group that is no pipeline is an error (NOTE: [A pp group that is no
// pipeline]): one that overlaps a gradient's mesh dimension or shards a
// gradient, and, at the first call, one whose ranks all have the same
// non-zero norm (replicas, e.g. the world group under DDP).
at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm, double norm_type = 2.0,
                           const std::optional<ProcessGroup>& pp = std::nullopt);

}  // namespace dtp
