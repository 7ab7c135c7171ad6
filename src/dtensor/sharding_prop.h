// Sharding propagation: which placements an op's inputs need and which its
// outputs get. Every rule (rule_registry.h) produces, per mesh dimension,
// candidate rows (input placements -> output placements); the propagator
// picks the cheapest row per mesh dimension given the inputs' current
// placements. Results are cached per thread.
#pragma once

#include "dtensor/rule_registry.h"

namespace dtp {

// The decision for `call`, from the per-thread cache or computed.
const Decision& propagate(const OpCall& call);
// Empties this thread's cache (benchmarks of the miss path).
void clear_propagation_cache();

// The cache holds at most this many decisions; full, it starts over.
constexpr size_t kPropagationCacheCapacity = 16384;
// This thread's cache: entries now, hits and misses since the thread began.
struct PropagationCacheStats {
  int64_t size = 0, hits = 0, misses = 0;
};
PropagationCacheStats propagation_cache_stats();

// Cost of moving `bytes` of one rank's shard from `from` to `to` on one mesh
// dimension; used to choose among rows.
double transition_cost(const Placement& from, const Placement& to, double bytes,
                       int64_t group_size);

}  // namespace dtp
