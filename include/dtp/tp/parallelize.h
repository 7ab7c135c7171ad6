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
// module (PyTorch silently skips, and users train with wrong gradients); the
// pattern "" is the module itself. The mesh must be 1-D: slice a larger one
// by name (mesh["tp"]). An empty plan changes nothing.
// Communication: besides what the styles' distribute_tensor calls send (none
// with src_data_rank = nullopt: each rank keeps its own data), one all_gather
// of 8 bytes per rank checks that the ranks registered the same sharding
// rules (NOTE: [Ranks agree on sharding rules]).
void parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh,
                        const ParallelizePlan& plan, std::optional<int> src_data_rank = 0);
// One style for the module itself.
void parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh,
                        const ParallelStyle& style, std::optional<int> src_data_rank = 0);
// The mesh from the enclosing DeviceMeshGuard (Python's `with mesh:`).
void parallelize_module(torch::nn::Module& module, const ParallelizePlan& plan,
                        std::optional<int> src_data_rank = 0);
void parallelize_module(torch::nn::Module& module, const ParallelStyle& style,
                        std::optional<int> src_data_rank = 0);
// No plan: checks the mesh (given, or the current one) and warns that nothing
// was done, as PyTorch's parallelize_module(module, mesh) does.
void parallelize_module(torch::nn::Module& module, std::optional<DeviceMesh> mesh = std::nullopt);

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
