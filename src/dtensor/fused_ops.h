// DTensor ops fused where autograd records no graph (NOTE: [Fused ops
// without autograd], fused_ops.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace dtp::detail {

// dtp::nn::rms_norm of DTensors as one local computation (`local` on the
// shards), where no graph is recorded and the placements allow it; else an
// undefined tensor, and the caller runs the decomposition.
using LocalRmsNorm = at::Tensor (*)(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, LocalRmsNorm local);

}  // namespace dtp::detail
