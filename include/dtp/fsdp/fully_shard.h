// fully_shard: FSDP2's data parallelism, composed with tensor parallelism on
// a (dp, tp) mesh as torchtitan does (TP first, then fully_shard).
//
//   dtp::models::apply_tensor_parallel(model, mesh);           // mesh (dp, tp)
//   for (auto& block : *model->layers) dtp::fully_shard(*block, mesh);
//   dtp::fully_shard(*model, mesh);                             // the root: the rest
//
// Each call makes one unit of the parameters of `module` that no earlier
// call took. Each parameter is then sharded on dim 0 over "dp", inside its
// TP shard: a DTensor on the (tp, dp) mesh with placements [its TP
// placement, S(0)], so a TP Shard(0) weight is cut exactly as PyTorch's
// _StridedShard cuts it, uneven sizes included. The module's registry (and
// so the optimizer and checkpoints) holds these sharded parameters.
//
// Per unit and step: before forward one all-gather over dp of the unit's
// parameters (flattened together); after forward the gathered parameters are
// freed (reshard_after_forward) and gathered again when backward reaches the
// unit; when backward has gone through the unit, one reduce-scatter (average
// over dp) of its gradients. The root unit (the first to run forward) keeps
// its parameters until its backward, as FSDP2 does. After the first step,
// each unit's all-gather is started one unit ahead, in forward and in
// backward, so that it overlaps compute.
//
// HSDP: on a mesh with dimensions named "dp_replicate" and "dp_shard" (and
// "tp" or not), parameters are sharded over dp_shard and replicated over
// dp_replicate: DTensors on the (tp, dp_replicate, dp_shard) mesh with
// [TP placement, R, S(0)]. The all-gathers and reduce-scatters run over
// dp_shard; after each reduce-scatter one all-reduce (average over
// dp_replicate) of the unit's shard. The batch is split over both.
#pragma once

#include "dtp/device_mesh.h"
#include "dtp/fsdp/mixed_precision_policy.h"

#include <torch/nn/module.h>

#include <optional>

namespace dtp {

struct FullyShardOptions {
  // Free the gathered parameters after forward and gather again for backward
  // (memory ~ one unit's parameters) or keep them until backward.
  bool reshard_after_forward = true;
  MixedPrecisionPolicy mp_policy;  // bf16 compute, float32 masters: see dtp/fsdp/mixed_precision_policy.h
  // The reduce-scatter sums the gradients over the data-parallel ranks and
  // divides by this (FSDP2's set_gradient_divide_factor); none: their number
  // (the mean). Expert parallelism sets dp x ep: an expert's gradient
  // already sums over the ep ranks' tokens.
  std::optional<double> gradient_divide_factor;
};

// `mesh`: 1-D (data parallel only), or with dimensions named "dp" and "tp"
// (the TP plan applied to mesh["tp"] first), or "dp" and "ep" (experts
// spread over mesh["ep"] first: apply_expert_parallel). `module` must run hooks (a
// DTP_MODULE or a dtp::nn module) and every module holding one of its
// parameters must be one set_parameter knows.
void fully_shard(torch::nn::Module& module, const DeviceMesh& mesh, FullyShardOptions options = {});

// True when `module` is a fully_shard unit.
bool is_fully_sharded(const torch::nn::Module& module);

}  // namespace dtp
