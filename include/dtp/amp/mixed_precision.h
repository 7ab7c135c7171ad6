// apply_mixed_precision: bf16 (or float16) compute with float32 master
// weights for a module without data parallelism: tensor parallelism alone,
// or one device. Under replicate or fully_shard pass the same policy as
// their mp_policy instead (ReplicateOptions / FullyShardOptions).
//
//   dtp::parallelize_module(model, mesh, plan);   // TP first (or nothing)
//   dtp::apply_mixed_precision(*model, {at::kBFloat16, at::kFloat});
//
// The registered parameters stay as they are (float32 DTensors or plain
// tensors: the optimizer steps them and checkpoints save them). Before each
// forward of `module` every parameter is cast to policy.param_dtype (a
// DTensor's local shard is cast, its placements kept) and forward reads the
// copies; backward produces their gradients in param_dtype, which reach the
// masters' .grad in the masters' dtype. TP's Partial gradients (a replicated
// norm weight under sequence parallelism) are summed over tp in
// policy.reduce_dtype: by the masters' end-of-backward buckets when it is
// their dtype, else in one all-reduce per tp group where backward has all
// the module's gradients. See NOTE: [Compute copies] in
// src/amp/mixed_precision.cpp. Float16 compute needs loss scaling:
// dtp::GradScaler (dtp/amp/grad_scaler.h).
#pragma once

#include "dtp/fsdp/mixed_precision_policy.h"

#include <torch/nn/module.h>

namespace dtp {

// `module` must run hooks (a DTP_MODULE or a dtp::nn module); apply it after
// parallelize_module and apply_ac. A module inside one that has it keeps its
// own policy (as fully_shard's units). Not on a module under replicate or
// fully_shard (theirs is mp_policy).
void apply_mixed_precision(torch::nn::Module& module, MixedPrecisionPolicy policy);

// True when apply_mixed_precision was applied to `module`.
bool has_mixed_precision(const torch::nn::Module& module);

}  // namespace dtp
