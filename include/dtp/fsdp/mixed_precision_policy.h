// MixedPrecisionPolicy: FSDP2's mixed-precision options, shared by
// fully_shard, replicate (DDP) and apply_mixed_precision (no data
// parallelism), so that every layout takes the same policy.
#pragma once

#include <c10/core/ScalarType.h>

#include <optional>

namespace dtp {

// The registered parameters (and so the optimizer's state and checkpoints)
// keep their dtype (float32: the master copy). Forward and backward compute
// with a copy in param_dtype made before each forward; the gradients are
// reduced (over dp, and TP's Partial sums over tp) in reduce_dtype, then kept
// in the parameters' dtype in .grad. PyTorch's FSDP2 MixedPrecisionPolicy
// (and DDP's _MixedPrecision without buffer_dtype: buffers keep their dtype).
struct MixedPrecisionPolicy {
  std::optional<c10::ScalarType> param_dtype;   // e.g. at::kBFloat16; none: the parameters' dtype
  std::optional<c10::ScalarType> reduce_dtype;  // e.g. at::kFloat; none: param_dtype
  bool cast_forward_inputs = true;              // floating-point inputs of the module to param_dtype
};

}  // namespace dtp
