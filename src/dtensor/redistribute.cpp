#include "dtensor/redistribute.h"

#include "comm/trace_span.h"
#include "dtensor/spec_facts.h"

#include <ATen/ATen.h>

namespace dtp {

// NOTE: [Async redistribution]
// redistribute(..., async_op=true) returns at once with a DTensor whose shard
// its last collective still computes (PyTorch's AsyncCollectiveTensor): the
// DTensorImpl holds a PendingLocal, and DTensorImpl::local() waits for it the
// first time anything reads the shard: any op on the DTensor (the dispatch
// fallback), to_local, full_tensor, a redistribution of it, autograd's
// gradient formulas (they run ops). Its metadata is known at once.
//  - Only the plan's last collective is left running: a later step needs an
//    earlier one's result, so every collective before it completes now (as
//    in PyTorch, whose next step waits on the previous AsyncCollectiveTensor).
//    Local steps after it (a chunk, zeros) run at the first use.
//  - Every collective is issued at the call, on the calling thread, in
//    program order: Gloo queues it on c10d's worker, NCCL on its stream, the
//    in-memory paths on the group's progress thread (NOTE: [Async collectives
//    on a LocalPath]). Counts (CommCounter) are taken at the call.
//  - A collective that fails throws at the first use, naming the
//    redistribution and the collective ("all_gather #3 ... failed: global
//    rank 1 did not reach it"), and again at every later use.
//  - Backward: the gradient's redistribution is synchronous.
//  - An unused result is never waited for: its collective completes
//    regardless (every rank issued it), and its buffers live until then.
// SyncRedistributeScope makes async_op=true synchronous on this thread.

namespace {

thread_local bool sync_redistribute = false;

// Size of tensor dim `d` before mesh dim `m` chunks it, on this rank.
int64_t sizeBefore(const DTensorSpec& spec, const Placements& p, size_t m, int64_t d,
                   const std::vector<int64_t>& coord) {
  int64_t n = spec.shape[d];
  for (size_t k = 0; k < m; ++k)
    if (p[k].is_shard(d)) n = chunk_size(n, spec.mesh.size(k), coord[k]);
  return n;
}

// Carries a shard through a plan's steps, one at a time.
struct Executor {
  const DTensorSpec& src;
  std::vector<int64_t> coord;
  Placements cur;
  at::Tensor t;
  bool backward;
  bool owned;  // t is ours to overwrite (the input given up, or a fresh result)
  bool masked = false;  // MaskPartial's mask applied (once, for every MaskP dim)

  // NOTE: [MaskPartial]: zeros where the value is another rank's, so the
  // shard becomes a plain partial sum. The mask covers the leading dims (an
  // embedding's [batch, seq] of [batch, seq, dim]) or all of them.
  void applyMask() {
    if (masked) return;
    masked = true;
    const at::Tensor mask = src.facts ? src.facts->mask : at::Tensor();
    if (!mask.defined()) return;
    TORCH_INTERNAL_ASSERT(mask.dim() == t.dim() || mask.dim() + 1 == t.dim(), "a MaskPartial mask of ",
                          mask.sizes(), " for a shard of ", t.sizes(), " (", src.str(), ")");
    const at::Tensor outside = mask.dim() == t.dim() ? mask : mask.unsqueeze(-1);
    t = owned ? t.masked_fill_(outside, 0) : t.masked_fill(outside, 0);
    owned = true;
  }

  Executor(const DTensorSpec& src, at::Tensor local, Placements cur, bool backward, bool owned)
      : src(src), coord(src.mesh.get_coordinate()), cur(std::move(cur)), t(std::move(local)), backward(backward),
        owned(owned) {}

  // Step `s`. With `pending`, its collective is left running there: t is
  // then the collective's input, or for an all_reduce its buffer (the result,
  // in place).
  void step(const RedistributeStep& s, Work* pending = nullptr) {
    const size_t m = static_cast<size_t>(s.mesh_dim);
    const int64_t n = src.mesh.size(s.mesh_dim);
    TORCH_CHECK(!s.to.is_mask_partial(), "redistribute: NYI: ", s.from.str(), " -> ", s.to.str(), " on mesh dim ",
                m, " for ", src.str(), ": only the op that makes a MaskPartial (the embedding of a vocabulary-"
                "sharded weight) knows its mask. Redistribute to Partial(), Replicate() or Shard instead.");
    if (s.from.is_mask_partial()) {  // the plan's first steps (NOTE: [Redistribute order])
      applyMask();
      cur[m] = s.to;
      return;
    }
    if (n == 1) {  // one rank holds the whole: every transition keeps the data
      cur[m] = s.to;
      return;
    }
    const bool async_op = pending != nullptr;
    auto finish = [&](Work w) {
      if (async_op) {
        *pending = std::move(w);
      } else {
        t = w.wait();
      }
      owned = true;
    };
    const int64_t me = coord[m];
    if (s.from.is_shard() && s.to.is_replicate()) {
      const ProcessGroup group = src.mesh.get_group(s.mesh_dim);
      const int64_t d = s.from.dim;
      finish(group.all_gather(t, d, chunk_sizes(sizeBefore(src, cur, m, d, coord), n), async_op));
    } else if (s.from.is_shard() && s.to.is_shard()) {
      const ProcessGroup group = src.mesh.get_group(s.mesh_dim);
      const int64_t i = s.from.dim, j = s.to.dim;
      finish(group.all_to_all(t, j, chunk_sizes(t.size(j), n), i, chunk_sizes(src.shape[i], n), async_op));
    } else if (s.from.is_partial() && s.to.is_replicate()) {
      const ProcessGroup group = src.mesh.get_group(s.mesh_dim);
      if (!owned) t = t.clone();
      finish(group.all_reduce(t, s.from.op, async_op));
    } else if (s.from.is_partial() && s.to.is_shard()) {
      const ProcessGroup group = src.mesh.get_group(s.mesh_dim);
      const int64_t d = s.to.dim;
      finish(group.reduce_scatter(t, d, chunk_sizes(t.size(d), n), s.from.op, async_op));
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
};

}  // namespace

at::Tensor run_redistribute(const at::Tensor& local, const DTensorSpec& src, const RedistributePlan& plan,
                            bool backward, bool consume) {
  if (plan.empty()) return local;
  TORCH_INTERNAL_ASSERT(plan.src == src.placements, "a plan from ", to_string(plan.src), " run on ", src.str());
  const detail::TraceSpan span([&] { return c10::str("redistribute ", src.str(), " -> (", to_string(plan.dst), ")"); });
  Executor ex(src, local, src.placements, backward, consume);
  for (const auto& s : plan.steps) ex.step(s);
  return ex.t;
}

std::shared_ptr<PendingLocal> run_redistribute_async(const at::Tensor& local, const SpecPtr& src,
                                                     const RedistributePlan& plan, bool consume) {
  TORCH_INTERNAL_ASSERT(plan.src == src->placements, "a plan from ", to_string(plan.src), " run on ", src->str());
  size_t last = plan.size();  // the last step that communicates
  for (size_t i = 0; i < plan.size(); ++i)
    if (plan.steps[i].collective) last = i;
  if (last == plan.size()) return nullptr;
  const detail::TraceSpan span(
      [&] { return c10::str("redistribute ", src->str(), " -> (", to_string(plan.dst), ") async"); });
  Executor ex(*src, local, src->placements, /*backward=*/false, consume);
  for (size_t i = 0; i < last; ++i) ex.step(plan.steps[i]);
  Work work;
  ex.step(plan.steps[last], &work);
  std::function<at::Tensor(at::Tensor)> finish;
  if (last + 1 < plan.size()) {
    finish = [src, rest = std::vector<RedistributeStep>(plan.steps.begin() + last + 1, plan.steps.end()),
              cur = ex.cur](at::Tensor t) {
      Executor after(*src, std::move(t), cur, /*backward=*/false, /*owned=*/true);
      for (const auto& s : rest) after.step(s);
      return after.t;
    };
  }
  const bool in_place = *plan.steps[last].collective == CollectiveType::AllReduce;
  return std::make_shared<PendingLocal>(std::move(work), std::move(finish), ex.t, /*like_layout=*/in_place, src,
                                        plan.dst);
}

SyncRedistributeScope::SyncRedistributeScope() : prev_(sync_redistribute) { sync_redistribute = true; }
SyncRedistributeScope::~SyncRedistributeScope() { sync_redistribute = prev_; }
bool SyncRedistributeScope::active() { return sync_redistribute; }

at::Tensor redistribute_local(const at::Tensor& local, const DTensorSpec& src,
                              const Placements& dst, bool backward, bool consume) {
  if (src.placements == dst) return local;
  return run_redistribute(local, src, cached_plan(src, dst), backward, consume);
}

}  // namespace dtp
