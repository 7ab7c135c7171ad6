// The collectives of ProcessGroup: each validates its arguments, then hands a
// call (what it moves, and how on each path) to the one pipeline of NOTE:
// [Collective pipeline] in collective_pipeline.h. Shapes as in NOTE: [Uneven
// shards] (process_group.cpp).
#include "comm/collective_calls.h"
#include "comm/exchange_calls.h"
#include "comm/collective_pipeline.h"
#include "dtp/process_group.h"

#include <ATen/ATen.h>

#include <numeric>

namespace dtp {

using detail::run_collective;

namespace {

void checkSizes(const ProcessGroup::Impl& g, const char* what, const char* name, const std::vector<int64_t>& sizes) {
  TORCH_CHECK(static_cast<int>(sizes.size()) == g.size, "dtp: ", what, ": got ", sizes.size(), " ", name,
              " for a group of ", g.size, " ranks, expected ", g.size, ". Pass one size per rank.");
}

int64_t sumOf(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

}  // namespace

// NOTE: [Zero-size collectives]
// Gloo divides by the element count and dies of SIGFPE on empty buffers. A
// collective whose buffers are empty on every rank moves nothing, so it is
// skipped (and not counted). Each rank can tell: the shapes that make it
// empty (the tensor's, or the per-rank sizes passed) are the same everywhere.

Work ProcessGroup::all_reduce(at::Tensor tensor, ReduceOp op, bool async_op) const {
  const Impl& g = impl();
  TORCH_CHECK(g.size == 1 || tensor.numel() == 0 || tensor.scalar_type() != at::kBool || op == ReduceOp::Max ||
                  op == ReduceOp::Min,
              "dtp: all_reduce: ", to_string(op), " of a bool tensor is not defined. Use ReduceOp::Max "
              "(logical or) or ReduceOp::Min (logical and), or convert to an integer type first.");
  detail::AllReduceCall call{std::move(tensor), op, g.size};
  return run_collective(impl_, call, async_op);
}

Work ProcessGroup::all_gather(const at::Tensor& local, int64_t dim, const std::vector<int64_t>& sizes,
                              bool async_op) const {
  const Impl& g = impl();
  checkSizes(g, "all_gather", "per-rank sizes", sizes);
  dim = c10::maybe_wrap_dim(dim, local.dim());
  TORCH_CHECK(local.size(dim) == sizes[g.rank], "dtp: all_gather: the local tensor has ", local.size(dim),
              " elements along dim ", dim, ", but sizes[", g.rank, "] = ", sizes[g.rank], ".");
  detail::AllGatherCall call(local, dim, sizes, g.size);
  return run_collective(impl_, call, async_op);
}

Work ProcessGroup::reduce_scatter(const at::Tensor& input, int64_t dim, const std::vector<int64_t>& sizes,
                                  ReduceOp op, bool async_op) const {
  const Impl& g = impl();
  checkSizes(g, "reduce_scatter", "per-rank sizes", sizes);
  dim = c10::maybe_wrap_dim(dim, input.dim());
  const int64_t total = sumOf(sizes);
  TORCH_CHECK(input.size(dim) == total, "dtp: reduce_scatter: the input has ", input.size(dim),
              " elements along dim ", dim, ", but the per-rank sizes add up to ", total, ".");
  detail::ReduceScatterCall call(input, dim, sizes, op, g.rank, g.size);
  return run_collective(impl_, call, async_op);
}

Work ProcessGroup::all_to_all(const at::Tensor& input, int64_t split_dim, const std::vector<int64_t>& split_sizes,
                              int64_t cat_dim, const std::vector<int64_t>& cat_sizes, bool async_op) const {
  const Impl& g = impl();
  checkSizes(g, "all_to_all", "split_sizes", split_sizes);
  checkSizes(g, "all_to_all", "cat_sizes", cat_sizes);
  split_dim = c10::maybe_wrap_dim(split_dim, input.dim());
  cat_dim = c10::maybe_wrap_dim(cat_dim, input.dim());
  TORCH_CHECK(split_dim != cat_dim, "dtp: all_to_all: got split_dim = cat_dim = ", split_dim,
              ", expected two different dims.");
  TORCH_CHECK(input.size(cat_dim) == cat_sizes[g.rank], "dtp: all_to_all: the input has ", input.size(cat_dim),
              " elements along dim ", cat_dim, ", expected cat_sizes[", g.rank, "] = ", cat_sizes[g.rank], ".");
  const int64_t split_total = sumOf(split_sizes);
  TORCH_CHECK(input.size(split_dim) == split_total, "dtp: all_to_all: the input has ", input.size(split_dim),
              " elements along dim ", split_dim, ", but split_sizes add up to ", split_total, ".");
  detail::AllToAllCall call(input, split_dim, split_sizes, cat_dim, cat_sizes, g.rank, g.size);
  return run_collective(impl_, call, async_op);
}

Work ProcessGroup::all_to_all_single(const at::Tensor& input, const std::vector<int64_t>& output_split_sizes,
                                     const std::vector<int64_t>& input_split_sizes, bool async_op) const {
  const Impl& g = impl();
  checkSizes(g, "all_to_all_single", "input_split_sizes", input_split_sizes);
  checkSizes(g, "all_to_all_single", "output_split_sizes", output_split_sizes);
  TORCH_CHECK(input.dim() >= 1, "dtp: all_to_all_single: the input is a scalar; expected rows along dim 0.");
  const int64_t in_rows = sumOf(input_split_sizes);
  TORCH_CHECK(input.size(0) == in_rows, "dtp: all_to_all_single: the input has ", input.size(0),
              " rows, but input_split_sizes ", c10::IntArrayRef(input_split_sizes), " add up to ", in_rows, ".");
  TORCH_CHECK(g.size > 1 || output_split_sizes[0] == input_split_sizes[0], "dtp: all_to_all_single: one rank sends ",
              input_split_sizes[0], " rows to itself but expects ", output_split_sizes[0], ".");
  detail::AllToAllSingleCall call(input, output_split_sizes, input_split_sizes, g.rank, g.size);
  return run_collective(impl_, call, async_op);
}

Work ProcessGroup::broadcast(at::Tensor tensor, int src, bool async_op) const {
  const Impl& g = impl();
  TORCH_CHECK(src >= 0 && src < g.size, "dtp: broadcast: from rank ", src, " in a group of ", g.size,
              " ranks, expected 0 <= src < ", g.size, ".");
  detail::BroadcastCall call{std::move(tensor), src, g.rank, g.size};
  return run_collective(impl_, call, async_op);
}

Work ProcessGroup::scatter(at::Tensor output, const std::vector<at::Tensor>& chunks, int src, bool async_op) const {
  const Impl& g = impl();
  TORCH_CHECK(src >= 0 && src < g.size, "dtp: scatter: from rank ", src, " in a group of ", g.size,
              " ranks, expected 0 <= src < ", g.size, ".");
  if (g.rank == src) {
    TORCH_CHECK(static_cast<int>(chunks.size()) == g.size, "dtp: scatter: the source rank got ", chunks.size(),
                " chunks, expected ", g.size, " (one per rank).");
    TORCH_CHECK(chunks[g.rank].sizes() == output.sizes(), "dtp: scatter: the source's own chunk ",
                chunks[g.rank].sizes(), " does not match its output ", output.sizes(), ".");
  }
  detail::ScatterCall call{std::move(output), chunks, src, g.rank, g.size};
  return run_collective(impl_, call, async_op);
}

void ProcessGroup::barrier() const {
  const Impl& g = impl();
  detail::BarrierCall call{g.size};
  run_collective(impl_, call, /*async_op=*/false);
}

}  // namespace dtp
