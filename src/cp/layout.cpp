// The sequence layouts of context parallelism: which global positions each
// cp rank holds, and sharding a global tensor into them and back.
#include "cp/layout.h"

#include "dtp/cp/context_parallel.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>

#include <numeric>

namespace dtp {

const char* to_string(CpLayout layout) {
  switch (layout) {
    case CpLayout::Contiguous: return "Contiguous";
    case CpLayout::HeadTail: return "HeadTail";
  }
  return "?";
}

// NOTE: [Head-tail chunk lengths]
// The head-tail layout cuts the sequence into 2*cp chunks and gives rank r
// chunks r and 2*cp-1-r, so that under a causal mask every rank's queries
// see, in total, the same number of keys: with chunks of c positions, rank
// r's queries attend to c*(r*c + (c+1)/2) + c*((2*cp-1-r)*c + (c+1)/2) =
// c^2*(2*cp-1) + c*(c+1) keys, whatever r. PyTorch and Megatron require S to
// divide by 2*cp; dtp takes any S >= 2*cp with chunk lengths b = S / (2*cp)
// or b + 1, the e = S % (2*cp) longer chunks placed where they cost least: a
// head chunk's queries see few keys, a tail chunk's nearly all. e <= cp: the
// heads of ranks 0..e-1 are one longer; e > cp: every chunk is one longer
// but the heads of ranks 0..2*cp-e-1. Every rank then holds every tail at
// the same length, the ranks' lengths differ by at most one (a head
// position), and their causal work by at most S (query, key) pairs (one
// query row; measured over cp 2..16, S up to 80*cp, in
// tests/context_parallel_test.cpp: the largest spread is 0.94*S). Placing
// them first (chunks 0..e-1) gives e > cp's short chunks to the tails of
// ranks 0, 1, ... and spreads the work up to 1.6*S; torch.chunk's lengths
// (all ceil(S / (2*cp)), the last short or empty: S = 9, cp = 4 gives
// 2,2,2,2,1,0,0,0) leave rank 0 with 3 pairs against rank 3's 24. The
// contiguous layout keeps torch.chunk's lengths, as Shard(seq_dim) does
// (S = 10, cp = 4 -> 3,3,3,1).
std::vector<SeqSegment> context_parallel_segments(int64_t seq_len, int64_t cp_size, int64_t cp_rank,
                                                  CpLayout layout) {
  TORCH_CHECK(cp_size >= 1 && cp_rank >= 0 && cp_rank < cp_size, "context_parallel: cp rank ", cp_rank,
              " of cp size ", cp_size, ", expected 0 <= rank < size and size >= 1.");
  TORCH_CHECK(seq_len >= 0, "context_parallel: got seq_len ", seq_len, ", expected >= 0.");
  if (layout == CpLayout::Contiguous) {
    const int64_t per = (seq_len + cp_size - 1) / cp_size;
    const int64_t start = std::min(cp_rank * per, seq_len);
    return {{start, std::min(per, seq_len - start)}};
  }
  const int64_t chunks = 2 * cp_size;
  TORCH_CHECK(seq_len >= chunks, "context_parallel: the HeadTail layout cuts the sequence into 2*cp = ", chunks,
              " chunks, but seq_len is ", seq_len, " (fewer positions than chunks). Use CpLayout::Contiguous for "
              "a sequence this short, or a smaller cp.");
  const int64_t base = seq_len / chunks, extra = seq_len % chunks;
  // Chunk i is one longer when it is among the first `extra` (extra <= cp),
  // or not among the first `chunks - extra` (extra > cp): only heads differ.
  const bool first_longer = extra <= cp_size;
  const int64_t split = first_longer ? extra : chunks - extra;
  const auto longer_before = [&](int64_t i) {  // longer chunks among 0..i-1
    return first_longer ? std::min(i, split) : std::max<int64_t>(0, i - split);
  };
  const auto chunk = [&](int64_t i) {
    const bool longer = first_longer ? i < split : i >= split;
    return SeqSegment{i * base + longer_before(i), base + (longer ? 1 : 0)};
  };
  return {chunk(cp_rank), chunk(chunks - 1 - cp_rank)};
}

int64_t context_parallel_local_len(int64_t seq_len, int64_t cp_size, int64_t cp_rank, CpLayout layout) {
  int64_t n = 0;
  for (const auto& s : context_parallel_segments(seq_len, cp_size, cp_rank, layout)) n += s.length;
  return n;
}

namespace cp {

std::vector<int64_t> localLens(int64_t seq_len, int64_t cp_size, CpLayout layout) {
  std::vector<int64_t> lens;
  for (const auto r : c10::irange(cp_size)) lens.push_back(context_parallel_local_len(seq_len, cp_size, r, layout));
  return lens;
}

at::Tensor positionsOf(const std::vector<SeqSegment>& segments, c10::Device device) {
  std::vector<at::Tensor> parts;
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  for (const auto& s : segments) parts.push_back(at::arange(s.start, s.start + s.length, opts));
  return parts.empty() ? at::empty({0}, opts) : at::cat(parts);
}

}  // namespace cp

at::Tensor context_parallel_position_ids(int64_t seq_len, const ProcessGroup& group, CpLayout layout,
                                        c10::Device device) {
  return cp::positionsOf(context_parallel_segments(seq_len, group.size(), group.rank(), layout), device);
}

at::Tensor context_parallel_shard(const at::Tensor& x, int64_t seq_dim, const ProcessGroup& group, CpLayout layout) {
  TORCH_CHECK(x.defined() && x.dim() >= 1, "context_parallel_shard: expected a tensor with a sequence dim, got ",
              x.defined() ? "a scalar" : "an undefined tensor", ".");
  seq_dim = c10::maybe_wrap_dim(seq_dim, x.dim());
  std::vector<at::Tensor> parts;
  for (const auto& s : context_parallel_segments(x.size(seq_dim), group.size(), group.rank(), layout))
    parts.push_back(x.narrow(seq_dim, s.start, s.length));
  return parts.size() == 1 ? parts[0] : at::cat(parts, seq_dim);
}

at::Tensor context_parallel_unshard(const at::Tensor& local, int64_t seq_dim, int64_t seq_len,
                                   const ProcessGroup& group, CpLayout layout) {
  TORCH_CHECK(local.defined() && local.dim() >= 1,
              "context_parallel_unshard: expected a tensor with a sequence dim, got ",
              local.defined() ? "a scalar" : "an undefined tensor", ".");
  seq_dim = c10::maybe_wrap_dim(seq_dim, local.dim());
  const int n = group.size(), r = group.rank();
  const std::vector<int64_t> lens = cp::localLens(seq_len, n, layout);
  TORCH_CHECK(local.size(seq_dim) == lens[r], "context_parallel_unshard: cp rank ", r, " holds ", local.size(seq_dim),
              " positions along dim ", seq_dim, ", but the ", to_string(layout), " layout of seq_len ", seq_len,
              " over cp ", n, " gives it ", lens[r], ". Pass the global seq_len the tensor was sharded from.");
  at::Tensor gathered = group.all_gather(local.contiguous(), seq_dim, lens).wait();
  if (layout == CpLayout::Contiguous) return gathered;  // rank order is position order
  std::vector<SeqSegment> order;
  for (const auto q : c10::irange(n))
    for (const auto& s : context_parallel_segments(seq_len, n, q, layout)) order.push_back(s);
  // gathered[i] holds position pos[i]; the result's position p is gathered[argsort(pos)[p]].
  const at::Tensor pos = cp::positionsOf(order, local.device());
  return gathered.index_select(seq_dim, std::get<1>(pos.sort()));
}

}  // namespace dtp
