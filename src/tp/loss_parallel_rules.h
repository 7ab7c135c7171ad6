// The sharding side of loss_parallel: the handlers for log_softmax and
// nll_loss on class-sharded logits (loss_parallel_rules.cpp), and the pieces
// of them that the fused cross-entropy (loss_parallel.cpp) reuses. The
// technique owns them: it registers them into the core's rule registry at
// run time (NOTE: [loss_parallel's handlers]).
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

// NOTE: [loss_parallel's handlers]
// The handlers live with the technique, not among the core's rules: the
// first LossParallelGuard registers them into the rule registry
// (RuleRegistry::add_technique_handler, which keeps each op's ordinary rule
// beside its handler and drops the decisions threads have cached). The
// forward handlers (_log_softmax, nll_loss_forward) take class-sharded
// logits only while this thread is inside a guard (loss_parallel_enabled);
// elsewhere they decline and the ops' ordinary rules take the call. The
// backward handlers need no such check: only a loss_parallel forward leaves
// class-sharded log-probabilities for them. Before the first guard nothing
// is registered, and the core knows nothing of loss_parallel beyond the two
// error hints it carries as data (rules/loss.cpp).
void register_loss_parallel_handlers();  // once per process; thread-safe
bool loss_parallel_enabled();            // this thread is inside a LossParallelGuard
void set_loss_parallel_enabled(bool on);

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
