// parallelize_module: PyTorch's torch.distributed.tensor.parallel API.
//
//   dtp::parallelize_module(*model, mesh["tp"], {
//       {"layers.*.attention.wq", dtp::ColwiseParallel()},
//       {"layers.*.attention.wo", dtp::RowwiseParallel()},
//   });
#pragma once

#include "dtp/tp/style.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dtp {

// One (FQN pattern, style) pair; `*` matches one whole name atom or part of
// one, as in PyTorch ("layers.*.mlp" or "layers.1*").
struct PlanEntry {
  template <class Style, class = std::enable_if_t<std::is_base_of_v<ParallelStyle, Style>>>
  PlanEntry(std::string fqn_pattern, Style style)
      : pattern(std::move(fqn_pattern)), style(std::make_shared<Style>(std::move(style))) {}
  std::string pattern;
  std::shared_ptr<const ParallelStyle> style;
};
using ParallelizePlan = std::vector<PlanEntry>;

// Applies the plan entries in order. Every pattern must match at least one
// module (PyTorch silently skips, and users train with wrong gradients). The
// mesh must be 1-D: slice a larger one by name (mesh["tp"]). An empty plan
// changes nothing.
void parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh,
                        const ParallelizePlan& plan, std::optional<int> src_data_rank = 0);
// One style for the module itself.
void parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh,
                        const ParallelStyle& style, std::optional<int> src_data_rank = 0);
// The mesh from the enclosing DeviceMeshGuard.
void parallelize_module(torch::nn::Module& module, const ParallelizePlan& plan,
                        std::optional<int> src_data_rank = 0);

// Makes `mesh` the current mesh of this thread for its lifetime (the C++ form
// of Python's `with mesh:`).
class DeviceMeshGuard {
 public:
  explicit DeviceMeshGuard(DeviceMesh mesh);
  ~DeviceMeshGuard();
  static std::optional<DeviceMesh> current();

 private:
  std::optional<DeviceMesh> prev_;
};

}  // namespace dtp
