// Gradient reduction's shared pieces: what a backward will accumulate, and
// for checkpoint, the gradient buckets of keep_grad_placements across a
// backward run inside backward.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/graph_task.h>

#include <unordered_map>

namespace dtp::detail {

// The running backward's nodes (autograd's GraphTask::exec_info_): empty when
// it runs every node (backward without `inputs`).
using ExecInfo = std::unordered_map<torch::autograd::Node*, torch::autograd::GraphTask::ExecInfo>;

// Whether backward `task` hands `param`'s gradient to its AccumulateGrad
// (adds it to .grad): not when torch::autograd::grad asked for other inputs.
bool accumulates_grad(const ExecInfo& task, const at::Tensor& param);

// Made inside a backward (checkpoint's node) before it runs a nested
// backward: the nested backward's Partial gradients go to this backward's
// buckets, reduced once at its end (NOTE: [Buckets of a nested backward]).
class OuterBackwardScope {
 public:
  OuterBackwardScope();
  ~OuterBackwardScope();
  OuterBackwardScope(const OuterBackwardScope&) = delete;
  OuterBackwardScope& operator=(const OuterBackwardScope&) = delete;

 private:
  const ExecInfo* prev_;
};

}  // namespace dtp::detail
