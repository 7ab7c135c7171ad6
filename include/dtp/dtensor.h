// DTensor: a distributed tensor that is a real at::Tensor. Any libtorch code
// (torch::nn modules, autograd, torch::optim) runs on it unchanged; every ATen
// op is propagated through sharding rules, redistributing inputs as needed.
//
//   auto mesh = dtp::init_device_mesh("cpu", {4}, {"tp"});
//   at::Tensor w = dtp::distribute_tensor(at::randn({16, 8}), mesh, {dtp::Shard(0)});
//   at::Tensor y = at::matmul(x, w.t());        // a DTensor
//   at::Tensor full = dtp::full_tensor(y);      // a plain tensor, on every rank
#pragma once

#include "dtp/device_mesh.h"
#include "dtp/dtensor_spec.h"
#include "dtp/placement.h"

#include <ATen/core/Tensor.h>

#include <optional>

namespace dtp {

bool is_dtensor(const at::Tensor& t);
// The spec of a DTensor; throws for a plain tensor.
const DTensorSpec& dtensor_spec(const at::Tensor& t);
const Placements& placements(const at::Tensor& t);
const DeviceMesh& device_mesh(const at::Tensor& t);

// Splits `tensor` (the full tensor; only the copy on mesh coordinate
// `src_data_rank` of each mesh dimension is read) into a DTensor. With
// src_data_rank = std::nullopt, every rank uses its own `tensor` without
// communication. The result is a leaf that requires grad if `tensor` does.
at::Tensor distribute_tensor(const at::Tensor& tensor, const DeviceMesh& mesh,
                             const Placements& placements,
                             std::optional<int> src_data_rank = 0);

// Makes gradients of the DTensor leaf `param` arrive with its own placements.
// distribute_tensor does this for tensors that require grad. The Partial(sum)
// gradients of replicated parameters are all-reduced together, one
// all-reduce per process group and dtype at the end of backward (see NOTE:
// [Bucketed gradient reduction]); hooks registered on `param` later see this
// rank's unreduced partial, as with DDP. Under create_graph they are reduced
// one by one as they arrive.
void keep_grad_placements(const at::Tensor& param);

// Wraps this rank's shard. The global shape is `shape`, or inferred assuming
// even shards. run_check (collective) verifies every rank's shard shape
// against it and, as PyTorch's, makes Replicate dims agree: `local` takes the
// values of the first rank of each such dim, in place. Differentiable: the
// gradient flows back to `local`.
at::Tensor from_local(const at::Tensor& local, const DeviceMesh& mesh,
                      const Placements& placements, bool run_check = false,
                      std::optional<std::vector<int64_t>> shape = std::nullopt);

// This rank's shard (shares memory). Differentiable: the gradient becomes a
// DTensor with `grad_placements` (default: this tensor's placements).
at::Tensor to_local(const at::Tensor& t, std::optional<Placements> grad_placements = std::nullopt);

// The whole tensor on every rank (all-gathers / all-reduces as needed).
at::Tensor full_tensor(const at::Tensor& t);

// The same tensor with other placements. Differentiable: the backward applies
// the reverse transition (a Partial source gets a Replicate gradient). To the
// same placements it is still a gradient boundary, as in PyTorch: a Partial
// gradient of a Replicate tensor is all-reduced there.
// async_op = true returns once the last collective is issued (PyTorch's
// AsyncCollectiveTensor): the result's shard is waited for, once, at its
// first use (any op on it, to_local, full_tensor, redistribute), and a
// failed collective throws there, naming it. Collectives before the last
// complete at the call; every rank must still issue the same redistributions
// in the same order. Gloo, NCCL and the shared-memory and two-level paths are
// all asynchronous (the latter on a progress thread per group). The backward
// is synchronous. See docs/dtensor.md, "Async redistribution".
at::Tensor redistribute(const at::Tensor& t, const DeviceMesh& mesh, const Placements& placements,
                        bool async_op = false);
// The same for a tensor the caller gives up (a temporary, std::move): when
// nothing else refers to its shard, a Partial is reduced in place, without
// the copy of the shard that PyTorch's (and the overload above) make.
at::Tensor redistribute(at::Tensor&& t, const DeviceMesh& mesh, const Placements& placements,
                        bool async_op = false);

// Inside this scope, plain tensors mixed with DTensors in one op are treated
// as replicated (PyTorch's implicit_replication()). Outside, that is an error
// (0-dim plain tensors are always allowed, as scalars).
class ImplicitReplicationGuard {
 public:
  ImplicitReplicationGuard();
  ~ImplicitReplicationGuard();
  static bool enabled();
};

// Inside this scope, an op without a sharding rule gathers its inputs to
// Replicate, runs on the full tensors and returns replicated DTensors,
// warning once per op. Outside, such an op is an error naming it.
class ReplicateFallbackGuard {
 public:
  ReplicateFallbackGuard();
  ~ReplicateFallbackGuard();
  static bool enabled();
};

// The ops dtp has sharding rules or handlers for, e.g. "aten::mm".
std::vector<std::string> supported_ops();

}  // namespace dtp
