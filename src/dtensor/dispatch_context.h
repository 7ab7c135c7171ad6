// The per-thread state that decides how an op on DTensors dispatches.
#pragma once

#include "dtensor/fused_ops.h"
#include "dtensor/sharding_prop.h"
#include "dtp/explicit_redistribute.h"

#include <ATen/core/function_schema.h>
#include <c10/util/hash.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace dtp::detail {

// NOTE: [Dispatch context]
// Everything the DTensor fallback reads besides its arguments and the rule
// registry, in one struct per thread, as PyTorch keeps it in the fields of
// its one OpDispatcher. Per thread, not per process: ranks may run as
// threads of one process (the tests, the shared-memory path), each with its
// own scopes open, and the hot path takes no lock.
//
// Switches (set by scopes, read on every op; see ContextSwitch):
//  - implicit_replication (ImplicitReplicationGuard): a plain tensor mixed
//    with DTensors is taken as Replicate instead of an error.
//  - replicate_fallback (ReplicateFallbackGuard): an op without a rule
//    gathers its inputs to Replicate instead of an error.
//  - decompose_fused (DecomposeFusedOpsGuard): linear, matmul and rms_norm
//    run decomposed, each piece a DTensor op (NOTE: [Fused ops without
//    autograd]).
//  - explicit_redistribute (ExplicitRedistributeGuard): a decision that
//    moves an input with a collective is an error or a warning; outside any
//    scope the environment decides (DTP_EXPLICIT_REDISTRIBUTE).
//  - mix_hint: the explanation a higher layer leaves for the "mix of plain
//    at::Tensor and DTensor" error (NOTE: [Mix hints]); set and consumed,
//    not scoped.
// Caches (what the fallback found once and reuses; each empties itself when
// rules_version() moves or it is full):
//  - decisions: sharding propagation's decisions with their redistribution
//    plans (NOTE: [Plans priced as they run]), and their hit/miss counts.
//  - op_infos: what the fallback needs of an op beyond its arguments.
//  - checked_user_rules: (op, mesh) pairs whose user rule the ranks agreed on
//    (NOTE: [Ranks agree on sharding rules]).
//  - warned_replicate: ops the replicate fallback has warned about.
// Not here: the redistribution planner's plan cache (redistribute_plan.cpp,
// below dispatch: redistribute() uses it without dispatching), and the
// per-thread state of the layers above the core, which is theirs:
// loss_parallel's flag and handlers (NOTE: [loss_parallel's handlers],
// src/tp/loss_parallel_rules.cpp), the collective and result tapes
// (src/comm), the random-number state (random_state.cpp: what a random op
// draws, not how it dispatches), the gradient buckets of a backward pass
// (grad_reduction.cpp), scratch buffers of the propagator's search
// (sharding_prop.cpp's candidateCost). Facts an op knows of one tensor
// (MaskPartial's mask, loss_parallel's row sums) are not thread state:
// they ride in the tensor's spec (NOTE: [Facts in specs]).

// A switch of the context: the value of the innermost live scope on this
// thread, else the caller's default. A scope leaves from wherever it is, so
// scopes ended out of order (heap-held guards, guards moved into other
// scopes) never leave a value behind. The one mechanism behind every public
// guard (ImplicitReplicationGuard, ReplicateFallbackGuard,
// DecomposeFusedOpsGuard, ExplicitRedistributeGuard): each enters with
// itself as the scope and leaves in its destructor.
template <class T>
class ContextSwitch {
 public:
  T get(T outside) const { return scopes_.empty() ? outside : scopes_.back().second; }
  void enter(const void* scope, T value) { scopes_.emplace_back(scope, value); }
  void leave(const void* scope) {
    for (auto it = scopes_.end(); it != scopes_.begin();) {
      if ((--it)->first == scope) {
        scopes_.erase(it);
        return;
      }
    }
  }
  size_t depth() const { return scopes_.size(); }

 private:
  std::vector<std::pair<const void*, T>> scopes_;  // innermost last
};

// What the fallback needs to know of an op beyond its arguments, found once
// per op and thread (no lock, no hashing of operator names per call).
struct OpInfo {
  Handler handler = nullptr;
  bool has_rule = false;
  bool writes = false;  // a return aliases a written argument (in place, out=)
  bool single_output = false;  // one return, writes nothing: selective AC's save list may keep it
  bool user_rule = false;  // register_sharding's: NOTE: [Ranks agree on sharding rules]
  FusedProduct product = FusedProduct::None;  // linear, matmul: NOTE: [Which products fuse]
};

// A call's cache key (sharding_prop.cpp's encodeCall).
using Signature = std::vector<int64_t>;
using SignatureHash = c10::hash<Signature>;

struct DispatchContext {
  // Switches.
  ContextSwitch<bool> implicit_replication;
  ContextSwitch<bool> replicate_fallback;
  ContextSwitch<bool> decompose_fused;
  ContextSwitch<ExplicitRedistributeMode> explicit_redistribute;
  std::shared_ptr<const std::string> mix_hint;

  // Caches.
  struct Decisions {
    std::unordered_map<Signature, PlannedDecision, SignatureHash> map;  // bounded: kPropagationCacheCapacity
    PropagationCacheStats stats;  // hits and misses since the thread began
    uint64_t rules_version = 0;
    Signature key;  // scratch for the key of the call being looked up
  } decisions;
  struct OpInfos {
    std::unordered_map<const c10::FunctionSchema*, OpInfo> map;
    uint64_t rules_version = 0;
  } op_infos;
  std::vector<std::pair<const c10::FunctionSchema*, DeviceMesh>> checked_user_rules;
  std::unordered_set<std::string> warned_replicate;
};

// This thread's context.
DispatchContext& dispatch_context();

}  // namespace dtp::detail
