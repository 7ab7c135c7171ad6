// What the ParallelStyles share: finding a module's hooks, and turning a
// forward's tensors into DTensors of a layout.
#pragma once

#include "dtp/device_mesh.h"
#include "dtp/nn/hooked.h"
#include "dtp/placement.h"

#include <optional>
#include <string>

namespace torch::nn {
class Module;
}

namespace dtp::tp_detail {

// `m`'s hooks; an error naming `style`, the FQN and the fix when it has none.
nn::HookHost& hooks_of(torch::nn::Module& m, const std::string& fqn, const std::string& style);

// A forward tensor as a DTensor: a plain tensor is this rank's shard of
// `layout`. `dim_size` gives the global size of a sharded dim when the module
// knows it (Rowwise Linear: in_features), so uneven shards stay exact; else
// shards are taken as even and from_local checks that. Undefined tensors and
// DTensors pass through.
at::Tensor as_dtensor(at::Tensor t, const DeviceMesh& mesh, Placement layout,
                      std::optional<int64_t> dim_size = std::nullopt);

// Redistributes only when the layout differs (PyTorch's styles do the same): a
// redistribute to the same placements would be a gradient boundary.
// Takes `t` over: a module output nobody else holds is reduced in place.
// `async_op`: as PyTorch's Colwise, Rowwise and SequenceParallel do, the
// result waits for its collective at first use (NOTE: [Async
// redistribution]).
at::Tensor relayout(at::Tensor t, const DeviceMesh& mesh, Placement p, bool async_op = false);

// relayout, then to_local when `use_local`.
at::Tensor to_layout(at::Tensor t, const DeviceMesh& mesh, Placement p, bool use_local, bool async_op = false);

}  // namespace dtp::tp_detail
