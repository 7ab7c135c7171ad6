#include "dtp/nn/modules.h"

#include <ATen/ATen.h>

namespace dtp::nn {

RMSNormImpl::RMSNormImpl(int64_t dim_, double eps_) : dim(dim_), eps(eps_) { reset(); }

void RMSNormImpl::reset() { weight = register_parameter("weight", at::ones({dim})); }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return x * at::rsqrt(x.pow(2).mean({-1}, /*keepdim=*/true) + eps) * weight;
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) { return rms_norm(x, weight, eps); }

}  // namespace dtp::nn
