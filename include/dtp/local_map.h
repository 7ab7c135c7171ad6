// local_map: runs a function of plain tensors on each rank's shards and wraps
// its results as DTensors (PyTorch's torch.distributed.tensor.experimental.
// local_map). For code that is simplest on local tensors: a fused kernel, a
// third-party op, a hand-written collective.
//
//   // x: S(0) on a 1-D mesh; each rank normalizes its rows on its own.
//   auto norm_rows = dtp::local_map(
//       [](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{in[0] / in[0].norm(2, -1, true)}; },
//       /*out_placements=*/{dtp::Placements{dtp::Shard(0)}},
//       /*in_placements=*/{dtp::Placements{dtp::Shard(0)}});
//   at::Tensor y = norm_rows({x})[0];  // a DTensor, S(0)
//
// It is differentiable: gradients flow through to_local and from_local.
#pragma once

#include "dtp/device_mesh.h"
#include "dtp/placement.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <functional>
#include <optional>
#include <vector>

namespace dtp {

using LocalMapFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;

struct LocalMapOptions {
  // The mesh of the outputs; default: the first DTensor input's.
  TORCH_ARG(std::optional<DeviceMesh>, device_mesh) = std::nullopt;
  // Redistribute a DTensor input whose placements differ from its
  // in_placements; without it, that is an error.
  TORCH_ARG(bool, redistribute_inputs) = false;
  // Global shapes of the outputs, per output (nullopt: inferred assuming even
  // shards). Needed for outputs sharded unevenly.
  TORCH_ARG(std::vector<std::optional<std::vector<int64_t>>>, out_shapes) = {};
};

// Returns a function that, given inputs of which at least one is a DTensor:
//  - checks each DTensor input's mesh and its placements against
//    in_placements[i] (empty: any placements are accepted), redistributing
//    when options.redistribute_inputs;
//  - calls `fn` on the local shards (plain inputs as they are; the gradient
//    of input i arrives with in_grad_placements[i], default its placements);
//  - wraps output o with from_local(out_placements[o]) without communication
//    (nullopt: returned as a plain tensor). A sharded output without its
//    out_shapes must have even shards: the first call for each set of input
//    shapes checks them (one all_gather of sizes per mesh dimension that
//    shards an output; NOTE: [Uneven local_map outputs]), and uneven ones
//    are an error asking for out_shapes.
// Given no DTensor input, it calls `fn` on the inputs as they are.
LocalMapFn local_map(LocalMapFn fn, std::vector<std::optional<Placements>> out_placements,
                     std::vector<std::optional<Placements>> in_placements = {},
                     std::vector<std::optional<Placements>> in_grad_placements = {},
                     LocalMapOptions options = LocalMapOptions());

}  // namespace dtp
