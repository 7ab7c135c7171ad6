// loss_parallel: cross-entropy on class-sharded logits without gathering them
// (PyTorch's torch.distributed.tensor.parallel.loss_parallel).
//
//   at::Tensor logits = model(tokens);   // DTensor, Shard(-1) over the vocab
//   dtp::LossParallelGuard lp;            // like Python's `with loss_parallel():`
//   auto loss = torch::nn::functional::cross_entropy(logits.flatten(0, 1), labels.flatten());
//   loss.backward();
//
// Forward: 3 all-reduces per sharded mesh dim (row max, row sum of exp, the
// target's log-probability); backward: none (the backward rules apply to
// class-sharded log-probabilities with or without the guard). Targets may be plain tensors
// (taken as replicated) or DTensors; `weight`, `ignore_index` and the
// reductions none/sum/mean are supported. Label smoothing is exact with
// reductions none and sum (its smoothing term costs a few more all-reduces;
// run backward inside the guard too); with a mean it is a clear error.
// Logits are shaped as cross_entropy takes them: [N, C], [C], or
// [N, C, d1, ...] (the class dim is 1, or 0 for 1-D), sharded on the class dim
// (logits sharded on another dim only are an error, as in PyTorch). 2-D
// logits take the fused path of loss_parallel_cross_entropy; others the
// guard's rules (same collectives and values).
#pragma once

#include "dtp/dtensor.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/options/loss.h>

namespace dtp {

// Also treats plain tensors as replicated (an ImplicitReplicationGuard), as
// loss code mixes the DTensor logits with plain targets and masks.
class LossParallelGuard {
 public:
  LossParallelGuard();
  ~LossParallelGuard();
  LossParallelGuard(const LossParallelGuard&) = delete;
  LossParallelGuard& operator=(const LossParallelGuard&) = delete;
  static bool enabled();

 private:
  bool prev_;
  ImplicitReplicationGuard implicit_;
};

// cross_entropy with a LossParallelGuard around it. On 2-D class-sharded
// logits without label smoothing it runs fused (one autograd node, the same
// all-reduces and values): its backward turns the saved log-probabilities
// into the gradient in place unless the graph is retained.
at::Tensor loss_parallel_cross_entropy(
    const at::Tensor& logits, const at::Tensor& target,
    const torch::nn::functional::CrossEntropyFuncOptions& options = {});

}  // namespace dtp
