#include "dtensor/redistribute.h"

#include "comm/trace_span.h"

#include <ATen/ATen.h>

namespace dtp {

std::optional<CollectiveType> transition_collective(const Placement& from, const Placement& to, int64_t group_size) {
  if (from == to || from.is_replicate() || group_size == 1) return std::nullopt;
  if (from.is_shard()) return to.is_shard() ? CollectiveType::AllToAll : CollectiveType::AllGather;
  return to.is_shard() ? CollectiveType::ReduceScatter : CollectiveType::AllReduce;
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
//  2. From the first mesh dimension to the last, move to the target: R -> S
//     (local chunk), P -> R (all_reduce), P -> S (reduce_scatter),
//     S(i) -> S(j) (all_to_all), R -> P (zeros off coordinate 0, for sum).

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

// Size of tensor dim `d` before mesh dim `m` chunks it, on this rank.
int64_t sizeBefore(const DTensorSpec& spec, const Placements& p, size_t m, int64_t d,
                   const std::vector<int64_t>& coord) {
  int64_t n = spec.shape[d];
  for (size_t k = 0; k < m; ++k)
    if (p[k].is_shard(d)) n = chunk_size(n, spec.mesh.size(k), coord[k]);
  return n;
}

}  // namespace

std::vector<RedistributeStep> plan_redistribute(const DTensorSpec& src, const Placements& dst) {
  TORCH_CHECK(dst.size() == src.placements.size(), "redistribute: got ", dst.size(),
              " target placements (", to_string(dst), ") for ", src.mesh.str(),
              ". Give one placement per mesh dimension.");
  for (const auto& p : dst) {
    TORCH_CHECK(!p.is_shard() || (p.dim >= 0 && p.dim < src.ndim()), "redistribute: ", p.str(),
                " is out of range for ", src.str(), ".");
  }
  std::vector<RedistributeStep> steps;
  Placements cur = src.placements;
  for (int64_t m = static_cast<int64_t>(cur.size()) - 1; m >= 0; --m) {
    if (canStay(cur, dst, m) || isAllToAll(cur, dst, m)) continue;
    const bool reduce_first = cur[m].is_partial() && dst[m].is_partial();
    if (cur[m].is_shard() || reduce_first) {
      steps.push_back({m, cur[m], Replicate()});
      cur[m] = Replicate();
    }
  }
  for (size_t m = 0; m < cur.size(); ++m) {
    if (cur[m] != dst[m]) {
      steps.push_back({static_cast<int64_t>(m), cur[m], dst[m]});
      cur[m] = dst[m];
    }
  }
  return steps;
}

at::Tensor redistribute_local(const at::Tensor& local, const DTensorSpec& src,
                              const Placements& dst, bool backward, bool consume) {
  const auto steps = plan_redistribute(src, dst);
  if (steps.empty()) return local;
  const detail::TraceSpan span([&] { return c10::str("redistribute ", src.str(), " -> (", to_string(dst), ")"); });
  const auto coord = src.mesh.get_coordinate();
  Placements cur = src.placements;
  at::Tensor t = local;
  bool owned = consume;  // t is ours to overwrite (the input given up, or a fresh result)
  for (const auto& s : steps) {
    const size_t m = static_cast<size_t>(s.mesh_dim);
    const int64_t n = src.mesh.size(s.mesh_dim);
    if (n == 1) {  // one rank holds the whole: every transition keeps the data
      cur[m] = s.to;
      continue;
    }
    const ProcessGroup group = src.mesh.get_group(s.mesh_dim);
    const int64_t me = coord[m];
    if (s.from.is_shard() && s.to.is_replicate()) {
      const int64_t d = s.from.dim;
      t = group.all_gather(t, d, chunk_sizes(sizeBefore(src, cur, m, d, coord), n)).wait();
      owned = true;
    } else if (s.from.is_shard() && s.to.is_shard()) {
      const int64_t i = s.from.dim, j = s.to.dim;
      t = group.all_to_all(t, j, chunk_sizes(t.size(j), n), i, chunk_sizes(src.shape[i], n)).wait();
      owned = true;
    } else if (s.from.is_partial() && s.to.is_replicate()) {
      t = group.all_reduce(owned ? t : t.clone(), s.from.op).wait();
      owned = true;
    } else if (s.from.is_partial() && s.to.is_shard()) {
      const int64_t d = s.to.dim;
      t = group.reduce_scatter(t, d, chunk_sizes(t.size(d), n), s.from.op).wait();
      owned = true;
    } else if (s.from.is_replicate() && s.to.is_shard()) {
      const int64_t d = s.to.dim;
      t = t.narrow(d, chunk_start(t.size(d), n, me), chunk_size(t.size(d), n, me));
    } else if (s.from.is_replicate() && s.to.is_partial()) {
      // Forward: the sum over ranks must give the value back. Backward: the
      // gradient of each rank's partial is the whole gradient.
      if (!backward && s.to.op == ReduceOp::Sum && me != 0) {
        t = at::zeros_like(t);
        owned = true;
      }
    } else {
      TORCH_CHECK(false, "redistribute: NYI transition ", s.from.str(), " -> ", s.to.str(),
                  " on mesh dim ", m, " for ", src.str(), ".");
    }
    cur[m] = s.to;
  }
  return t;
}

}  // namespace dtp
