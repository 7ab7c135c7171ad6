// The matrix-vector product of the one-row linear (NOTE: [One-row linear]
// in local_linear.cpp), where a faster kernel than the BLAS's exists here.
#pragma once

#include <ATen/core/Tensor.h>

namespace dtp::detail {

// w [n, k] (float32 or float64, dense rows: stride(1) == 1, stride(0) >= k)
// times v [k] of w's dtype, plus bias [n] where defined: [n]. Undefined
// (nothing computed) where this build, this CPU or this thread count has
// no faster kernel than the BLAS's; the caller then runs at::mv. NOTE: [Eigen GEMV] in gemv.cpp.
at::Tensor gemv(const at::Tensor& w, const at::Tensor& v, const at::Tensor& bias);

}  // namespace dtp::detail
