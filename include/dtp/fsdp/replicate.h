// replicate: DDP's data parallelism (PyTorch's composable replicate),
// composed with tensor parallelism on a (dp, tp) mesh.
//
//   dtp::models::apply_tensor_parallel(model, mesh);   // mesh (dp, tp)
//   dtp::replicate(*model, mesh);
//
// Parameters stay as TP left them, whole on every dp rank. Their gradients
// are grouped in buckets (in reverse parameter order, about the order
// backward produces them); a bucket is all-reduced over dp (average), as one
// flat tensor and without waiting, as soon as backward has produced all of
// its gradients, so communication overlaps the rest of backward. The end of
// backward waits for the buckets and puts the averaged gradients in place
// (a replicated TP parameter's Partial gradient is also summed over tp
// there, one all-reduce per bucket that has one). See NOTE: [Overlapped
// bucket reduction] in src/fsdp/replicate.cpp. On a mesh named for HSDP
// (dp_replicate, dp_shard) the average runs over both dimensions together.
// With activation checkpointing inside (apply_ac before replicate), each
// checkpointed block's recomputation runs a backward of its own: a bucket
// is all-reduced once in every backward that reaches it.
//
// Mixed precision (ReplicateOptions::mp_policy, the policy fully_shard
// takes): the registered parameters stay float32 (the masters the optimizer
// steps); before each forward each bucket casts them to param_dtype (a
// DTensor's local shard, placements kept) and forward reads the copies; the
// bucket's gradients arrive in param_dtype, are all-reduced (and summed over
// tp) in reduce_dtype and land in the masters' .grad in their dtype. As
// PyTorch DDP's _MixedPrecision, without buffer_dtype (buffers keep theirs).
#pragma once

#include "dtp/device_mesh.h"
#include "dtp/fsdp/mixed_precision_policy.h"

#include <torch/nn/module.h>

#include <optional>
#include <string>
#include <vector>

namespace dtp {

struct ReplicateOptions {
  // Bytes of gradients per bucket, as DDP's bucket_cap_mb.
  double bucket_cap_mb = 25.0;
  // The all-reduce sums the gradients and divides by this; none: the number
  // of data-parallel ranks (the mean). See FullyShardOptions.
  std::optional<double> gradient_divide_factor;
  // bf16 compute with float32 masters and, with reduce_dtype = at::kFloat,
  // float32 all-reduces. Unset: the parameters' dtype throughout.
  MixedPrecisionPolicy mp_policy;
};

// `mesh`: 1-D (data parallel only), or with dimensions named "dp" and "tp"
// (the TP plan applied to mesh["tp"] first). `module` must run hooks (a
// DTP_MODULE or a dtp::nn module).
void replicate(torch::nn::Module& module, const DeviceMesh& mesh, ReplicateOptions options = {});

// The parameters of each bucket of a replicate()d module, by FQN, in the
// order their all-reduces are issued.
std::vector<std::vector<std::string>> replicate_buckets(const torch::nn::Module& module);

}  // namespace dtp
