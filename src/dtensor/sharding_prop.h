// Sharding propagation: which placements an op's inputs need and which its
// outputs get. Every rule (rule_registry.h) produces, per mesh dimension,
// candidate rows (input placements -> output placements); the propagator
// picks the candidate (one row per mesh dimension) whose redistribution
// plans cost least given the inputs' current placements (NOTE: [Plans
// priced as they run]). Results, plans included, are cached per thread.
#pragma once

#include "dtensor/redistribute_plan.h"
#include "dtensor/rule_registry.h"

namespace dtp {

// A decision with, per input slot, the plan from the input's placements to
// in[slot]: what the fallback runs on a cache hit, without planning again.
struct PlannedDecision : Decision {
  std::vector<RedistributePlan> in_plans;  // per slot; empty where nothing moves
};

// The decision for `call`, from the per-thread cache or computed.
const PlannedDecision& propagate(const OpCall& call);
// Empties this thread's cache (benchmarks of the miss path).
void clear_propagation_cache();

// The cache holds at most this many decisions; full, it starts over.
constexpr size_t kPropagationCacheCapacity = 16384;
// This thread's cache: entries now, hits and misses since the thread began.
struct PropagationCacheStats {
  int64_t size = 0, hits = 0, misses = 0;
};
PropagationCacheStats propagation_cache_stats();

// Candidates (products of one row per mesh dim) priced whole; a rule whose
// rows make more than this many is priced one mesh dim at a time.
constexpr size_t kMaxPricedCandidates = 4096;

}  // namespace dtp
