#include "dtp/nn/modules.h"

#include "dtensor/fused_ops.h"
#include "dtensor/local_linear.h"

#include <ATen/ATen.h>

namespace dtp::nn {

RMSNormImpl::RMSNormImpl(int64_t dim_, double eps_) : dim(dim_), eps(eps_) { reset(); }

void RMSNormImpl::reset() { weight = register_parameter("weight", at::ones({dim})); }

namespace {

// Half-precision inputs normalize in float32 and return to their dtype
// before the weight, as Hugging Face's LlamaRMSNorm: in float16 the
// derivative of rsqrt(mean(x^2)), r^3, overflows for activations below
// about 0.02 (r^3 > 65504).
at::Tensor plainRmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (x.scalar_type() != at::kHalf && x.scalar_type() != at::kBFloat16)
    return x * at::rsqrt(x.pow(2).mean({-1}, /*keepdim=*/true) + eps) * weight;
  const at::Tensor h = x.to(at::kFloat);
  return (h * at::rsqrt(h.pow(2).mean({-1}, /*keepdim=*/true) + eps)).to(x.scalar_type()) * weight;
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor fused = dtp::detail::fused_rms_norm(x, weight, eps, plainRmsNorm);
  return fused.defined() ? fused : plainRmsNorm(x, weight, eps);
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) { return rms_norm(x, weight, eps); }

at::Tensor detail::linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias) {
  return dtp::detail::local_linear(input, weight, bias);
}

}  // namespace dtp::nn
