#include "dtensor/redistribute_plan.h"

#include <c10/util/hash.h>

#include <unordered_map>

namespace dtp {

std::optional<CollectiveType> transition_collective(const Placement& from, const Placement& to, int64_t group_size) {
  if (from == to || from.is_replicate() || group_size == 1) return std::nullopt;
  if (from.is_mask_partial() && to.is_partial()) return std::nullopt;  // applies the mask
  if (to.is_mask_partial()) return std::nullopt;  // NYI (kImpossibleStep): never run
  if (from.is_shard()) return to.is_shard() ? CollectiveType::AllToAll : CollectiveType::AllGather;
  return to.is_shard() ? CollectiveType::ReduceScatter : CollectiveType::AllReduce;
}

// NOTE: [Plans priced as they run]
// A redistribution is planned once per (source spec, target placements)
// into steps (plan_redistribute), and that plan is both what sharding
// propagation prices a candidate by and what the executor runs: the
// decision cache keeps each input's plan, so a cache hit runs the cached
// steps without planning again (PyTorch caches _gen_transform_infos and
// prices with the same one-step costs it runs).
// A step's cost, with n the tensor's global element count and w the ranks
// of the step's mesh dim: all_gather n(w-1), all_to_all and reduce_scatter
// n(w-1)/w, all_reduce 2n(w-1)/w, a local step (chunk, zeroing, a one-rank
// dim) n/1000: free of communication but still work, so keeping a
// placement wins over a local change. n is global for every step, never a
// rank's shard or the size after an earlier step: every rank must price
// alike (an empty shard would make all candidates free on one rank), and
// the relative weights of the collectives stay those propagation has
// always used, so its decisions stay where they were. PyTorch scales the
// bytes per step (after an all_gather, later steps move more); dtp does not.
// A step into MaskPartial (from anything else) is NYI: only the op that
// makes one knows its mask (NOTE: [MaskPartial]). It costs kImpossibleStep,
// finite so that sums stay comparable, so propagation never picks it while
// any other candidate exists; the executor refuses to run it.
double step_cost(const Placement& from, const Placement& to, double numel, int64_t group_size) {
  if (from == to) return 0;
  if (to.is_mask_partial()) return kImpossibleStep;
  const double w = static_cast<double>(group_size);
  const auto collective = transition_collective(from, to, group_size);
  if (!collective) return numel * 1e-3;
  switch (*collective) {
    case CollectiveType::AllGather: return numel * (w - 1);
    case CollectiveType::AllReduce: return 2 * numel * (w - 1) / w;
    default: return numel * (w - 1) / w;  // all_to_all, reduce_scatter
  }
}

std::string RedistributeStep::str() const {
  return "dim" + std::to_string(mesh_dim) + " " + from.str() + "->" + to.str() + " " +
         (collective ? to_string(*collective) : "local");
}

std::string RedistributePlan::str() const {
  std::string s = to_string(src) + " -> " + to_string(dst) + ": [";
  for (size_t i = 0; i < steps.size(); ++i) s += (i ? ", " : "") + steps[i].str();
  return s + "]";
}

// NOTE: [Redistribute order]
// Shards nest in mesh order: with S(0)S(0) on a (2,2) mesh, mesh dim 0 chunks
// the rows and mesh dim 1 chunks each half again. A mesh dimension's shard
// can therefore stay only if every earlier mesh dimension shards the same
// tensor dimension identically before and after. The plan:
//  1. From the last mesh dimension to the first, gather (S -> R) every shard
//     that cannot stay; later shards of the same tensor dim are gone by then,
//     so each gather sees a proper chunk. S(i) -> S(j) is kept for step 2 as
//     one all_to_all when no other mesh dimension shards i or j.
//     A Partial whose target is a Partial of another op is reduced (-> R).
//  0. A MaskPartial source that does not stay as it is first becomes
//     P(sum) on each of its MaskP dims, locally: the first such step applies
//     the spec's mask (NOTE: [MaskPartial]), before any step changes the
//     shard's shape. A MaskPartial target is then reached from P(sum) by a
//     step that costs kImpossibleStep and never runs.
//  2. From the first mesh dimension to the last, move to the target: R -> S
//     (local chunk), P -> R (all_reduce), P -> S (reduce_scatter),
//     S(i) -> S(j) (all_to_all), R -> P (zeros off coordinate 0, for sum).
// Example, f32[8,16] on a (2,2) mesh, S(0)S(0) -> RS(0): mesh dim 1's S(0)
// cannot stay (dim 0 no longer chunks the rows first), so
// [dim1 S(0)->R all_gather, dim0 S(0)->R all_gather, dim1 R->S(0) local].

namespace {

bool shardsDimElsewhere(const Placements& p, int64_t mesh_dim, int64_t tensor_dim) {
  for (size_t m = 0; m < p.size(); ++m)
    if (static_cast<int64_t>(m) != mesh_dim && p[m].is_shard(tensor_dim)) return true;
  return false;
}

// Mesh dims before `m` that shard tensor dim `d`, as a bit mask.
uint64_t shardPrefix(const Placements& p, size_t m, int64_t d) {
  uint64_t mask = 0;
  for (size_t k = 0; k < m; ++k)
    if (p[k].is_shard(d)) mask |= uint64_t{1} << k;
  return mask;
}

bool canStay(const Placements& cur, const Placements& dst, size_t m) {
  if (cur[m] != dst[m]) return false;
  return !cur[m].is_shard() || shardPrefix(cur, m, cur[m].dim) == shardPrefix(dst, m, cur[m].dim);
}

bool isAllToAll(const Placements& cur, const Placements& dst, size_t m) {
  return cur[m].is_shard() && dst[m].is_shard() && cur[m].dim != dst[m].dim &&
         !shardsDimElsewhere(cur, m, cur[m].dim) && !shardsDimElsewhere(cur, m, dst[m].dim) &&
         !shardsDimElsewhere(dst, m, cur[m].dim) && !shardsDimElsewhere(dst, m, dst[m].dim);
}

thread_local RedistributePlanStats stats;

}  // namespace

RedistributePlan plan_redistribute(const DTensorSpec& src, const Placements& dst) {
  TORCH_CHECK(dst.size() == src.placements.size(), "redistribute: got ", dst.size(),
              " target placements (", to_string(dst), ") for ", src.mesh.str(),
              ". Give one placement per mesh dimension.");
  for (const auto& p : dst) {
    TORCH_CHECK(!p.is_shard() || (p.dim >= 0 && p.dim < src.ndim()), "redistribute: ", p.str(),
                " is out of range for ", src.str(), ".");
  }
  ++stats.planned;
  RedistributePlan plan;
  plan.src = src.placements;
  plan.dst = dst;
  const double numel = static_cast<double>(src.numel());
  auto add = [&](int64_t m, const Placement& from, const Placement& to) {
    const int64_t w = src.mesh.size(m);
    plan.steps.push_back({m, from, to, transition_collective(from, to, w), step_cost(from, to, numel, w)});
    plan.cost += plan.steps.back().cost;
  };
  Placements cur = src.placements;
  if (cur != dst) {
    for (size_t m = 0; m < cur.size(); ++m) {
      if (!cur[m].is_mask_partial()) continue;
      add(static_cast<int64_t>(m), cur[m], Partial(cur[m].op));
      cur[m] = Partial(cur[m].op);
    }
  }
  for (int64_t m = static_cast<int64_t>(cur.size()) - 1; m >= 0; --m) {
    if (canStay(cur, dst, m) || isAllToAll(cur, dst, m)) continue;
    const bool reduce_first = cur[m].is_partial() && dst[m].is_partial();
    if (cur[m].is_shard() || reduce_first) {
      add(m, cur[m], Replicate());
      cur[m] = Replicate();
    }
  }
  for (size_t m = 0; m < cur.size(); ++m) {
    if (cur[m] != dst[m]) {
      add(static_cast<int64_t>(m), cur[m], dst[m]);
      cur[m] = dst[m];
    }
  }
  return plan;
}

int64_t placement_key(const Placement& p) {
  if (p.is_mask_partial()) {  // the table's size and dim too (a MaskP(0,9) plan is not a MaskP(0,10) one)
    return -((p.size * 1024 + p.dim) * 16 + static_cast<int64_t>(p.op)) - 1;
  }
  return static_cast<int64_t>(p.kind) * 1024 + (p.is_shard() ? p.dim : static_cast<int64_t>(p.op));
}

namespace {

using PlanKey = std::vector<int64_t>;
using PlanKeyHash = c10::hash<PlanKey>;

// Everything a plan depends on: the mesh's shape (which steps are
// collectives, their cost), the tensor's rank (the check of target dims) and
// element count (the cost), and both placements. Not the mesh's identity
// nor the dtype: meshes of one shape plan alike.
void encodePlanKey(PlanKey& key, const DTensorSpec& src, const Placements& dst) {
  const int64_t mesh_ndim = src.mesh.ndim();
  key.push_back(mesh_ndim);
  for (int64_t m = 0; m < mesh_ndim; ++m) key.push_back(src.mesh.size(m));
  key.push_back(src.ndim());
  key.push_back(src.numel());
  for (const auto& p : src.placements) key.push_back(placement_key(p));
  key.push_back(static_cast<int64_t>(dst.size()));
  for (const auto& p : dst) key.push_back(placement_key(p));
}

thread_local std::unordered_map<PlanKey, RedistributePlan, PlanKeyHash> plan_cache;

}  // namespace

const RedistributePlan& cached_plan(const DTensorSpec& src, const Placements& dst) {
  thread_local PlanKey key;
  key.clear();
  encodePlanKey(key, src, dst);
  auto it = plan_cache.find(key);
  if (it != plan_cache.end()) {
    ++stats.cache_hits;
    return it->second;
  }
  RedistributePlan plan = plan_redistribute(src, dst);
  // Bounded: programs with ever-new shapes must not grow it forever.
  if (plan_cache.size() >= kPlanCacheCapacity) plan_cache.clear();
  return plan_cache.emplace(key, std::move(plan)).first->second;
}

RedistributePlanStats redistribute_plan_stats() {
  RedistributePlanStats s = stats;
  s.cache_size = static_cast<int64_t>(plan_cache.size());
  return s;
}

void clear_redistribute_plan_cache() { plan_cache.clear(); }

}  // namespace dtp
