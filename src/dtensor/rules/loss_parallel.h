// The core of loss_parallel (rules/loss_parallel.cpp): the per-thread switch
// that dtp::LossParallelGuard turns on, and the fused cross-entropy that
// dtp::loss_parallel_cross_entropy tries first.
#pragma once

#include <ATen/core/Tensor.h>

namespace dtp {

bool loss_parallel_enabled();
void set_loss_parallel_enabled(bool on);

// cross_entropy of 2-D logits sharded on the class dim (optionally the batch
// dim), in one autograd node: the same all-reduces and arithmetic as
// log_softmax + nll_loss, its backward making the gradient in place of the
// saved log-probabilities. `reduction` is at::Reduction's. Undefined when the
// logits are not such a DTensor (the caller then takes the op-by-op path).
at::Tensor fused_cross_entropy(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& weight,
                               int64_t reduction, int64_t ignore_index);

}  // namespace dtp
