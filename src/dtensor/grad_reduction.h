// For checkpoint: the gradient buckets of keep_grad_placements across a
// backward run inside backward.
#pragma once

#include <torch/csrc/autograd/graph_task.h>

#include <unordered_map>

namespace dtp::detail {

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
  const std::unordered_map<torch::autograd::Node*, torch::autograd::GraphTask::ExecInfo>* prev_;
};

}  // namespace dtp::detail
