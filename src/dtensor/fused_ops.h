// The fused kernels' side of dispatch (NOTE: [Fused ops without autograd],
// fused_ops.cpp): which products fuse, the fallback's step that decomposes
// the others, the autograd-key kernels, and rms_norm's local computation.
// Dispatch calls into this file; this file never calls back into dispatch.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <cstdint>

namespace dtp::detail {

// The CompositeImplicitAutograd products dtp runs as one DTensor op.
enum class FusedProduct : uint8_t { None, Linear, Matmul };
FusedProduct fused_product_of(const c10::OperatorHandle& op);
// Their names, for the fallback's PrivateUse1 registration.
constexpr const char* kFusedProductOps[] = {"linear", "matmul"};

// NOTE: [Which products fuse]
// The one shape rule for aten::linear and aten::matmul on DTensors: x times
// a 2-D matrix (linear's weight [out, in], matmul's [in, out]), x at least
// 1-D for linear and 2-D for matmul (matmul of a vector by a matrix is left
// to ATen's decomposition, an unsqueezed mm). rules/matrix.cpp's byMatrix
// models exactly these shapes; the fallback decomposes the others
// (decompose_product) and the autograd kernels fuse only these.
inline bool fuses_as_product(FusedProduct kind, int64_t x_dim, int64_t matrix_dim) {
  return kind != FusedProduct::None && matrix_dim == 2 && x_dim >= (kind == FusedProduct::Linear ? 1 : 2);
}

// The fallback's "fused products" step: for a linear or matmul whose shapes
// do not fuse, or under DecomposeFusedOpsGuard, runs ATen's decomposition
// on the stack (each piece a DTensor op) and returns true; else false, and
// the fallback runs the op as one DTensor op by its rule.
bool decompose_product(FusedProduct kind, torch::jit::Stack& stack);

// Gives aten::linear and aten::matmul their autograd-key kernels for
// DTensors (the fused graph, the decomposition, or on to the DTensor key).
// Called by ensure_dtensor_dispatch, which routes their DTensor key to the
// fallback.
void register_fused_ops();

// dtp::nn::rms_norm of DTensors as one local computation (`local` on the
// shards), where no graph is recorded and the placements allow it; else an
// undefined tensor, and the caller runs the decomposition. Not a step of
// the fallback: rms_norm has no ATen op, so nn::rms_norm asks here first.
using LocalRmsNorm = at::Tensor (*)(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, LocalRmsNorm local);

}  // namespace dtp::detail
