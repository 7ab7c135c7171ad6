// The local kernels of linear and of a product by a matrix, shared by
// dtp::nn::Linear on plain tensors and by DTensor's linear and matmul on
// their shards: ATen's own op, except for one row on the CPU, which becomes
// a matrix-vector product (NOTE: [One-row linear], local_linear.cpp).
#pragma once

#include "dtensor/rule_registry.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace dtp::detail {

// at::linear(x, weight, bias) for plain tensors: x [..., k] times weight
// [n, k] plus bias [n] (undefined: none) -> [..., n]. DTensors go to
// at::linear (whose fallback runs linear_local on the shards).
at::Tensor local_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);
// at::matmul(x, m) for plain tensors and a 2-D m [k, n]: the same path where
// m is a transposed weight (m.t() has dense rows), as libtorch's
// LinearImpl::forward computes x.matmul(weight.t()).
at::Tensor local_matmul(const at::Tensor& x, const at::Tensor& m);

// Whether local_linear takes the matrix-vector path for these arguments
// (tests ask, to name a case that should and one that should not).
bool takes_one_row_path(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

// The rules' LocalFns of aten::linear and aten::matmul (rules/matrix.cpp):
// the op on the stack's shards by local_linear / local_matmul.
void linear_local(const c10::OperatorHandle& op, torch::jit::Stack* stack, const Decision& d);
void matmul_local(const c10::OperatorHandle& op, torch::jit::Stack* stack, const Decision& d);

}  // namespace dtp::detail
