// Hooked versions of the stock libtorch modules, and RMSNorm (which libtorch
// 1.13 lacks). Each is the stock Impl: same options, fields and forward,
// except that Linear's forward calls aten::linear, as Python's nn.Linear
// does. libtorch's LinearImpl::forward (F::linear) spells it
// input.matmul(weight.t()): two DTensor ops (t, matmul) on every call where
// aten::linear is one (NOTE: [Fused ops without autograd]). On plain
// tensors it is the same kernels, but for a bias on a 3-d input, which
// aten::linear folds into one addmm (rounding may differ in the last bit).
#pragma once

#include "dtp/nn/hooked.h"

#include <ATen/ops/linear.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

namespace dtp::nn {

// The forward of a Linear converted by to_weight_only (NOTE: [Weight-only
// linears] in dtp/nn/quantize.h): x [..., k] (float32 or float64) times the
// narrow weight [n, k] -> [..., n] in x's dtype, plus `bias` when defined;
// `scales` is defined for int8 weights only.
at::Tensor weight_only_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                              const at::Tensor& bias);

namespace detail {
// at::linear(input, weight, bias), except that one row of float32 or
// float64 on the CPU with no graph recorded runs as a matrix-vector product
// (NOTE: [One-row linear], src/dtensor/local_linear.cpp). DTensors go to
// at::linear, whose local op takes the same path.
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias);
}  // namespace detail

template <>
class HookedImpl<torch::nn::LinearImpl> : public torch::nn::LinearImpl, public HookHost {
 public:
  using torch::nn::LinearImpl::LinearImpl;
  at::Tensor forward(const at::Tensor& input) {
    if (weight_only) return weight_only_linear(input, weight, weight_scales, bias);
    return detail::linear(input, weight, bias);
  }
  // Set by dtp::nn::to_weight_only: the weight is stored narrow (bf16,
  // float16, int8 with the "weight_scales" buffer).
  bool weight_only = false;
  at::Tensor weight_scales;
};

class Linear : public Hooked<torch::nn::LinearImpl> {
 public:
  using Hooked<torch::nn::LinearImpl>::Hooked;
};
class Embedding : public Hooked<torch::nn::EmbeddingImpl> {
 public:
  using Hooked<torch::nn::EmbeddingImpl>::Hooked;
};
class LayerNorm : public Hooked<torch::nn::LayerNormImpl> {
 public:
  using Hooked<torch::nn::LayerNormImpl>::Hooked;
};
class Dropout : public Hooked<torch::nn::DropoutImpl> {
 public:
  using Hooked<torch::nn::DropoutImpl>::Hooked;
};

// y = x / sqrt(mean(x^2, last dim) + eps) * weight; float16 and bf16 x
// normalized in float32 and cast back before the weight (as HF's).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

class RMSNormImpl : public torch::nn::Cloneable<RMSNormImpl> {
 public:
  explicit RMSNormImpl(int64_t dim, double eps = 1e-6);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  int64_t dim;
  double eps;
  at::Tensor weight;
};
DTP_MODULE(RMSNorm);

}  // namespace dtp::nn
