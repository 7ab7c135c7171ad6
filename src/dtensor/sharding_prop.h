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

// Cost of moving `bytes` of one rank's shard from `from` to `to` on one mesh
// dimension; used to choose among rows.
double transition_cost(const Placement& from, const Placement& to, double bytes,
                       int64_t group_size);

}  // namespace dtp
