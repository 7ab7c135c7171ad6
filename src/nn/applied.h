// What each technique (fully_shard, replicate, checkpoint_wrapper) applied
// to a module, as HookHost::applied records it: how tp/, fsdp/ and ac/ see
// one another's work on a module without including one another.
#pragma once

#include "dtp/nn/hooked.h"

#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <vector>

namespace dtp::detail {

// The names HookHost::applied records, one per technique.
namespace technique {
inline constexpr const char* kFullyShard = "fully_shard";
inline constexpr const char* kReplicate = "replicate";
inline constexpr const char* kCheckpointWrapper = "checkpoint_wrapper";
inline constexpr const char* kMixedPrecision = "apply_mixed_precision";
}  // namespace technique

// The hooks of `module`; an error naming `api` and the fix when it has none.
nn::HookHost& hooks_of(torch::nn::Module& module, const char* api);

// The state `technique` left on `module`, or null.
std::shared_ptr<void> applied_state(const torch::nn::Module& module, const std::string& technique);
bool was_applied(const torch::nn::Module& module, const std::string& technique);
// The first of `techniques` applied to `module` or a descendant, or "".
std::string applied_below(torch::nn::Module& module, const std::vector<std::string>& techniques);

// While alive on this thread, a checkpointed function runs again in backward
// (ac/ opens it; fsdp/ keeps gathered parameters through it).
class RecomputeScope {
 public:
  RecomputeScope();
  ~RecomputeScope();
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;
};
bool in_recompute();

// While alive on this thread, a checkpointed function's first pass runs
// (without grad, but to be differentiated through its recomputation).
class CheckpointFirstPassScope {
 public:
  CheckpointFirstPassScope();
  ~CheckpointFirstPassScope();
  CheckpointFirstPassScope(const CheckpointFirstPassScope&) = delete;
  CheckpointFirstPassScope& operator=(const CheckpointFirstPassScope&) = delete;
};
// A forward that backward will differentiate: grad on, or a checkpoint's
// first pass.
bool forward_for_backward();

}  // namespace dtp::detail
