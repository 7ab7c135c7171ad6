// The sharding side of loss_parallel (rules/loss_parallel.cpp): the handlers
// for log_softmax and nll_loss on class-sharded logits, and the pieces of
// them that the fused cross-entropy (src/tp/loss_parallel.cpp) reuses. The
// technique, not the core, owns the switch that turns the forward handlers
// on: NOTE: [loss_parallel's switch].
#pragma once

#include "dtensor/dtensor_impl.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace dtp::detail {

// NOTE: [loss_parallel's switch]
// The forward handlers (_log_softmax, nll_loss_forward) take class-sharded
// logits only where loss_parallel is on; elsewhere such a call goes to the
// ops' ordinary rules. The backward handlers need no switch. The switch is
// dtp::LossParallelGuard's per-thread state (src/tp/loss_parallel.cpp): the
// guard hands the core the function that reads it, so that the core never
// includes the technique. Before any guard exists the forward handlers
// decline.
using LossParallelSwitch = bool (*)();
void set_loss_parallel_switch(LossParallelSwitch on);

// Mesh dims sharding the class dim and (for 2-D logits) the batch dim.
struct ClassSharding {
  std::vector<size_t> class_dims, batch_dims;
  Placements rows;  // per-row tensors (targets, losses): Shard(0) on batch dims
};

// What nll_loss(2d) forward and backward share: class-sharded logits ([C],
// [N, C] or [N, C, H, W]) as rows [rows, local classes], this rank's targets,
// and per row where the target's column lives and its weight. Nothing when
// the logits are not class-sharded (the ordinary rules take the call).
struct NllCall {
  const DTensorImpl* impl;
  int64_t class_dim;
  ClassSharding cs;
  at::Tensor lp;                      // [rows, local classes]
  at::Tensor target;                  // this rank's targets, in their shape
  std::vector<int64_t> target_shape;  // global
  at::Tensor index;                   // [rows, 1] local column of the target (clamped)
  at::Tensor here;                    // [rows] the target's column is on this rank
  at::Tensor weight;                  // [rows] weight of the target, 0 where ignored
};

// The NllCall of nll_loss's arguments `args` (their indices given);
// `validate` checks the targets' range.
std::optional<NllCall> nll_call(c10::ArrayRef<c10::IValue> args, size_t self, size_t target, size_t weight,
                               size_t ignore_index, bool validate);
// log_softmax of class columns over the whole (sharded) class dim.
at::Tensor local_log_softmax(const at::Tensor& x, int64_t dim, const DTensorSpec& s,
                           const std::vector<size_t>& class_dims);
// nll_loss_forward on the log-probabilities [rows, local classes]: (loss, total weight).
std::pair<at::Tensor, at::Tensor> nll_forward(const NllCall& c, const at::Tensor& logp, int64_t reduction);
// d loss / d (row's loss term) from the output's gradient, per row.
at::Tensor row_coeff(const NllCall& c, const DeviceMesh& mesh, const at::Tensor& grad_out, const at::Tensor& total,
                    int64_t reduction);

}  // namespace dtp::detail
