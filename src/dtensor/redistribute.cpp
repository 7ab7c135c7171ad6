#include "dtensor/redistribute.h"

#include "comm/trace_span.h"

#include <ATen/ATen.h>

namespace dtp {

namespace {

// Size of tensor dim `d` before mesh dim `m` chunks it, on this rank.
int64_t sizeBefore(const DTensorSpec& spec, const Placements& p, size_t m, int64_t d,
                   const std::vector<int64_t>& coord) {
  int64_t n = spec.shape[d];
  for (size_t k = 0; k < m; ++k)
    if (p[k].is_shard(d)) n = chunk_size(n, spec.mesh.size(k), coord[k]);
  return n;
}

}  // namespace

at::Tensor run_redistribute(const at::Tensor& local, const DTensorSpec& src, const RedistributePlan& plan,
                            bool backward, bool consume) {
  if (plan.empty()) return local;
  TORCH_INTERNAL_ASSERT(plan.src == src.placements, "a plan from ", to_string(plan.src), " run on ", src.str());
  const detail::TraceSpan span([&] { return c10::str("redistribute ", src.str(), " -> (", to_string(plan.dst), ")"); });
  const auto coord = src.mesh.get_coordinate();
  Placements cur = src.placements;
  at::Tensor t = local;
  bool owned = consume;  // t is ours to overwrite (the input given up, or a fresh result)
  for (const auto& s : plan.steps) {
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

at::Tensor redistribute_local(const at::Tensor& local, const DTensorSpec& src,
                              const Placements& dst, bool backward, bool consume) {
  if (src.placements == dst) return local;
  return run_redistribute(local, src, cached_plan(src, dst), backward, consume);
}

}  // namespace dtp
