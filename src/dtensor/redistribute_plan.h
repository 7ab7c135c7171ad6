// The redistribute planner: which steps take one rank's shard from a source
// spec to target placements, and what each step costs. Planned once per
// (source, target) and run by the executor (redistribute.h) as often as
// needed; sharding propagation prices its candidates with the same plans
// (NOTE: [Plans priced as they run]).
#pragma once

#include "dtp/comm_counter.h"
#include "dtp/dtensor_spec.h"

#include <optional>
#include <string>
#include <vector>

namespace dtp {

// One step of a redistribution: a single mesh dimension changes placement,
// by a collective or locally, at a cost (step_cost).
struct RedistributeStep {
  int64_t mesh_dim = 0;
  Placement from, to;
  std::optional<CollectiveType> collective;  // nullopt: local (a chunk, zeroing, or a one-rank dim)
  double cost = 0;

  // "dim1 S(0)->R all_gather", "dim0 R->S(1) local"
  std::string str() const;
};

// The ordered steps from `src` placements to `dst`, and their total cost.
struct RedistributePlan {
  Placements src, dst;
  std::vector<RedistributeStep> steps;
  double cost = 0;  // the sum of the steps' costs

  bool empty() const { return steps.empty(); }
  size_t size() const { return steps.size(); }
  std::vector<RedistributeStep>::const_iterator begin() const { return steps.begin(); }
  std::vector<RedistributeStep>::const_iterator end() const { return steps.end(); }
  // "S(0)S(0) -> RS(0): [dim1 S(0)->R all_gather, dim0 S(0)->R all_gather, dim1 R->S(0) local]"
  std::string str() const;
};

// The collective one step runs on a mesh dimension of `group_size` ranks,
// or nullopt when it is local (from R: a chunk or zeroing; a one-rank dim;
// MaskP -> P: applying the mask): S -> S all_to_all, S -> R or P
// all_gather, P -> S reduce_scatter, P -> R all_reduce.
std::optional<CollectiveType> transition_collective(const Placement& from, const Placement& to, int64_t group_size);

// The cost of a step that cannot run (into MaskPartial): above any real
// plan's, finite so that sums of it still compare.
constexpr double kImpossibleStep = 1e100;

// What one step costs when the tensor has `numel` elements globally, on a
// mesh dimension of `group_size` ranks. See NOTE: [Plans priced as they run].
double step_cost(const Placement& from, const Placement& to, double numel, int64_t group_size);

// Plans src -> dst, the way PyTorch's _redistribute.py does. See NOTE:
// [Redistribute order] in redistribute_plan.cpp. Computes afresh.
RedistributePlan plan_redistribute(const DTensorSpec& src, const Placements& dst);

// One placement as one integer, distinct for distinct placements (a shard
// dim below 1024; MaskPartial's keys are negative): the placements' part of cache keys (plans, decisions).
int64_t placement_key(const Placement& p);

// The plan for src -> dst from this thread's cache (ranks may run as
// threads; no lock), computed on a miss. The reference is valid until the
// next cached_plan call on this thread.
const RedistributePlan& cached_plan(const DTensorSpec& src, const Placements& dst);

// The plan cache holds at most this many plans; full, it starts over.
constexpr size_t kPlanCacheCapacity = 4096;

// This thread's planner: plans computed (plan_redistribute calls, from any
// caller, propagation's pricing included), cached_plan hits, cache entries.
struct RedistributePlanStats {
  int64_t planned = 0, cache_hits = 0, cache_size = 0;
};
RedistributePlanStats redistribute_plan_stats();
// Empties this thread's plan cache (tests, benchmarks of the miss path).
void clear_redistribute_plan_cache();

}  // namespace dtp
