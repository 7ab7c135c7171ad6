#include "dtp/nn/modules.h"

#include "dtensor/fused_ops.h"
#include "dtensor/local_linear.h"

#include <ATen/ATen.h>

namespace dtp::nn {

RMSNormImpl::RMSNormImpl(int64_t dim_, double eps_) : dim(dim_), eps(eps_) { reset(); }

void RMSNormImpl::reset() { weight = register_parameter("weight", at::ones({dim})); }

namespace {

at::Tensor plainRmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return x * at::rsqrt(x.pow(2).mean({-1}, /*keepdim=*/true) + eps) * weight;
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
