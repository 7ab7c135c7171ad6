// One call type per collective, as NOTE: [Collective pipeline] asks: what it
// sends and expects (the cross-rank check), when it is empty, and how it runs
// on a LocalPath and on a c10d backend. Here the reductions, broadcast and
// barrier; the all-to-all family and scatter in exchange_calls.h. Arguments arrive validated
// (collectives.cpp); a call lives for one run_collective and holds
// references to its caller's arguments, except a kAsyncLocal call, which
// owns them: the progress thread runs a copy later (NOTE: [Async collectives
// on a LocalPath]).
#pragma once

#include "comm/collective_check.h"
#include "comm/local_path.h"
#include "comm/process_group_impl.h"
#include "dtp/comm_counter.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>
#include <tuple>
#include <vector>

namespace dtp::detail {

inline int64_t nbytes(const at::Tensor& t) { return t.numel() * t.element_size(); }

inline c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:  // Gloo has no AVG: sum, then divide.
      return c10d::ReduceOp::SUM;
    case ReduceOp::Max: return c10d::ReduceOp::MAX;
    case ReduceOp::Min: return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

// Half and bfloat16 are reduced in float32 on a LocalPath and rounded once.
inline bool widened(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf;
}

inline int64_t numel_of(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

// The shape of `like` with `dim` resized.
inline std::vector<int64_t> chunk_shape(const at::Tensor& like, int64_t dim, int64_t size_at_dim) {
  auto shape = like.sizes().vec();
  shape[dim] = size_at_dim;
  return shape;
}

// Shape of `t` with `dim` moved to the front and resized.
inline std::vector<int64_t> front_shape(const at::Tensor& t, int64_t dim, int64_t front, int64_t other_dim = -1,
                                       int64_t other = 0) {
  auto shape = t.sizes().vec();
  if (other_dim >= 0) shape[other_dim] = other;
  shape.erase(shape.begin() + dim);
  shape.insert(shape.begin(), front);
  return shape;
}

// "Float[2, 4]" and "[2, 2]", for the call descriptions of NOTE: [Collective checks].
inline std::string shape_text(const at::Tensor& t) { return c10::str(c10::toString(t.scalar_type()), t.sizes()); }
inline std::string list_text(const std::vector<int64_t>& v) { return c10::str(c10::IntArrayRef(v)); }

// all_to_all over flattened buffers with per-peer element counts, on the
// backend of `in`.
inline c10::intrusive_ptr<c10d::Work> all_to_all_flat(const ProcessGroup::Impl& g, at::Tensor& out, at::Tensor& in,
                                                   std::vector<int64_t> out_counts, std::vector<int64_t> in_counts) {
  at::Tensor out_wire = as_gloo_dtype(out), in_wire = as_gloo_dtype(in);
  return issue_on_backend(
      g, in, [&](compat::Backend& b) { return b.alltoall_base(out_wire, in_wire, out_counts, in_counts); });
}

struct AllReduceCall {
  static constexpr CollectiveType kType = CollectiveType::AllReduce;
  static constexpr const char* kWhat = "all_reduce";
  static constexpr bool kKeepsResult = true, kHasLocalPath = true, kAsyncLocal = true;
  at::Tensor tensor;  // in place
  ReduceOp op;
  int size;
  at::Tensor buf;  // what c10d reduces: `tensor`, or a contiguous (float32 for bfloat16) copy

  at::Tensor* in_place() { return &tensor; }
  const at::Tensor& carrier() const { return tensor; }
  at::Tensor one_rank() { return tensor; }
  WireContract contract() const {
    return {kWhat, c10::str("all_reduce(", to_string(op), ") of ", shape_text(tensor)), tensor.scalar_type(),
            std::vector<int64_t>(size, tensor.numel()), std::vector<int64_t>(size, tensor.numel())};
  }
  bool empty() const { return tensor.numel() == 0; }
  at::Tensor empty_result() { return tensor; }
  int64_t bytes() const { return nbytes(tensor); }
  int64_t local_bytes() const { return tensor.numel() * (widened(tensor) ? 4 : tensor.element_size()); }
  bool local(LocalPath& path, at::Tensor& result) {
    at::Tensor b = widened(tensor) ? tensor.to(at::kFloat) : tensor.contiguous();
    at::Tensor flat = as_gloo_dtype(b).view({-1});
    path.all_reduce(flat, op);
    if (!b.is_same(tensor)) tensor.copy_(b);
    result = tensor;
    return true;
  }
  c10::intrusive_ptr<c10d::Work> issue(const ProcessGroup::Impl& g) {
    buf = tensor.scalar_type() == at::kBFloat16 ? tensor.to(at::kFloat)
          : tensor.is_contiguous()              ? tensor
                                                : tensor.contiguous();
    std::vector<at::Tensor> bufs{as_gloo_dtype(buf)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = to_c10d(op);
    return issue_on_backend(g, buf, [&](compat::Backend& b) { return b.allreduce(bufs, opts); });
  }
  auto then() {
    return [tensor = tensor, buf = buf, op = op, size = size]() mutable {
      if (op == ReduceOp::Avg) buf.div_(size);
      if (!buf.is_same(tensor)) tensor.copy_(buf);
      return tensor;
    };
  }
};

// Rank r's flat shard in `flat[r]`, each viewed as its chunk of `like`
// along `dim` (sizes[r] there) and joined along `dim`.
inline at::Tensor join_shards(const std::vector<at::Tensor>& flat, const at::Tensor& like, int64_t dim,
                              const std::vector<int64_t>& sizes) {
  std::vector<at::Tensor> pieces;
  for (size_t r = 0; r < sizes.size(); ++r) pieces.push_back(flat[r].view(chunk_shape(like, dim, sizes[r])));
  return at::cat(pieces, dim);
}

// Every rank's shard, flattened; Gloo pads each to the largest one.
struct AllGatherCall {
  static constexpr CollectiveType kType = CollectiveType::AllGather;
  static constexpr const char* kWhat = "all_gather";
  static constexpr bool kKeepsResult = true, kHasLocalPath = true, kAsyncLocal = true;
  at::Tensor local_;
  int64_t dim;
  std::vector<int64_t> sizes;
  int size;
  int64_t total = 0, gathered = 0, max_numel = 0;
  std::vector<int64_t> numels;  // of each rank's shard
  at::Tensor out;               // c10d's: [size, max_numel]

  AllGatherCall(const at::Tensor& local, int64_t dim, const std::vector<int64_t>& sizes, int size)
      : local_(local), dim(dim), sizes(sizes), size(size) {
    total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
    if (size == 1) return;
    for (int64_t s : sizes) numels.push_back(numel_of(chunk_shape(local, dim, s)));
    max_numel = *std::max_element(numels.begin(), numels.end());
    gathered = numel_of(chunk_shape(local, dim, total));
  }
  at::Tensor* in_place() { return nullptr; }
  const at::Tensor& carrier() const { return local_; }
  at::Tensor one_rank() { return local_; }
  WireContract contract() const {
    return {kWhat, c10::str("all_gather of ", shape_text(local_), " along dim ", dim, " with sizes ", list_text(sizes)),
            local_.scalar_type(), std::vector<int64_t>(size, max_numel), std::vector<int64_t>(size, max_numel)};
  }
  bool empty() const { return gathered == 0; }
  at::Tensor empty_result() { return at::empty(chunk_shape(local_, dim, total), local_.options()); }
  int64_t bytes() const { return gathered * local_.element_size(); }
  int64_t local_bytes() const { return max_numel * local_.element_size(); }
  bool local(LocalPath& path, at::Tensor& result) {
    at::Tensor flat = at::empty({gathered}, local_.options());
    path.all_gather(local_.contiguous().view({-1}), numels, flat);
    result = dim == 0 ? flat.view(chunk_shape(local_, dim, total))
                      : join_shards(flat.split_with_sizes(numels), local_, dim, sizes);
    return true;
  }
  c10::intrusive_ptr<c10d::Work> issue(const ProcessGroup::Impl& g) {
    at::Tensor in = local_.contiguous().view({-1});
    if (in.numel() < max_numel) in = at::cat({in, in.new_zeros({max_numel - in.numel()})});
    out = at::empty({size, max_numel}, local_.options());
    std::vector<std::vector<at::Tensor>> outs(1);
    for (int r = 0; r < size; ++r) outs[0].push_back(as_gloo_dtype(out[r]));
    std::vector<at::Tensor> ins{as_gloo_dtype(in)};
    return issue_on_backend(g, in, [&](compat::Backend& b) { return b.allgather(outs, ins); });
  }
  auto then() {
    const bool even = std::all_of(numels.begin(), numels.end(), [&](int64_t n) { return n == max_numel; });
    return [out = out, like = local_, dim = dim, total = total, sizes = sizes, numels = numels, even] {
      if (even && dim == 0) return out.view(chunk_shape(like, 0, total));
      std::vector<at::Tensor> flat;
      for (size_t r = 0; r < sizes.size(); ++r) flat.push_back(out[r].narrow(0, 0, numels[r]));
      return join_shards(flat, like, dim, sizes);
    };
  }
};

// Along `dim` moved to the front: rank q's piece of every rank, reduced. On
// c10d an all_to_all of the pieces, reduced here; on a LocalPath at once.
struct ReduceScatterCall {
  static constexpr CollectiveType kType = CollectiveType::ReduceScatter;
  static constexpr const char* kWhat = "reduce_scatter";
  static constexpr bool kKeepsResult = true, kHasLocalPath = true, kAsyncLocal = true;
  at::Tensor input;
  int64_t dim;
  std::vector<int64_t> sizes;
  ReduceOp op;
  int me, size;
  int64_t inner = 0;  // elements per index along `dim`
  std::vector<int64_t> in_counts, out_counts;
  at::Tensor out;  // c10d's: [size * sizes[me] * inner]

  ReduceScatterCall(const at::Tensor& input, int64_t dim, const std::vector<int64_t>& sizes, ReduceOp op, int me,
                    int size)
      : input(input), dim(dim), sizes(sizes), op(op), me(me), size(size) {
    if (size == 1) return;
    const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
    inner = input.numel() == 0 ? numel_of(front_shape(input, dim, 1)) : input.numel() / total;
    for (int64_t s : sizes) in_counts.push_back(s * inner);
    out_counts.assign(size, sizes[me] * inner);
  }
  at::Tensor flat() const { return input.movedim(dim, 0).contiguous().view({-1}); }
  at::Tensor* in_place() { return nullptr; }
  const at::Tensor& carrier() const { return input; }
  at::Tensor one_rank() { return op == ReduceOp::Avg ? input.clone() : input; }
  WireContract contract() const {
    return {kWhat,
            c10::str("reduce_scatter of ", shape_text(input), " along dim ", dim, " with sizes ", list_text(sizes)),
            input.scalar_type(), in_counts, out_counts};
  }
  bool empty() const { return input.numel() == 0; }
  at::Tensor empty_result() { return at::empty(chunk_shape(input, dim, sizes[me]), input.options()); }
  int64_t bytes() const { return nbytes(input); }
  int64_t local_bytes() const { return input.numel() * (widened(input) ? 4 : input.element_size()); }
  bool local(LocalPath& path, at::Tensor& result) {
    at::Tensor in = flat();
    const at::Tensor mine = path.reduce_scatter(widened(input) ? in.to(at::kFloat) : in, in_counts, op);
    result = mine.to(input.scalar_type()).view(front_shape(input, dim, sizes[me])).movedim(0, dim).contiguous();
    return true;
  }
  c10::intrusive_ptr<c10d::Work> issue(const ProcessGroup::Impl& g) {
    at::Tensor in = flat();
    out = at::empty({size * sizes[me] * inner}, input.options());
    return all_to_all_flat(g, out, in, out_counts, in_counts);
  }
  auto then() {
    auto recv_shape = front_shape(input, dim, sizes[me]);
    recv_shape.insert(recv_shape.begin(), size);
    return [out = out, recv_shape = std::move(recv_shape), op = op, size = size, dim = dim] {
      at::Tensor stacked = out.view(recv_shape);
      at::Tensor r;
      switch (op) {
        case ReduceOp::Sum: r = stacked.sum(0); break;
        case ReduceOp::Avg: r = stacked.sum(0).div_(size); break;
        case ReduceOp::Max: r = std::get<0>(stacked.max(0)); break;
        case ReduceOp::Min: r = std::get<0>(stacked.min(0)); break;
      }
      return r.movedim(0, dim).contiguous();
    };
  }
};

struct BroadcastCall {
  static constexpr CollectiveType kType = CollectiveType::Broadcast;
  static constexpr const char* kWhat = "broadcast";
  static constexpr bool kKeepsResult = true, kHasLocalPath = true, kAsyncLocal = true;
  at::Tensor tensor;  // in place
  int src, me, size;
  at::Tensor buf;  // `tensor`, or a contiguous copy

  at::Tensor* in_place() { return &tensor; }
  const at::Tensor& carrier() const { return tensor; }
  at::Tensor one_rank() { return tensor; }
  WireContract contract() const {
    std::vector<int64_t> send(size, me == src ? tensor.numel() : 0), recv(size, 0);
    recv[src] = tensor.numel();
    return {kWhat, c10::str("broadcast of ", shape_text(tensor), " from rank ", src), tensor.scalar_type(),
            std::move(send), std::move(recv)};
  }
  bool empty() const { return tensor.numel() == 0; }
  at::Tensor empty_result() { return tensor; }
  int64_t bytes() const { return nbytes(tensor); }
  int64_t local_bytes() const { return nbytes(tensor); }
  bool local(LocalPath& path, at::Tensor& result) {
    buf = tensor.is_contiguous() ? tensor : tensor.contiguous();
    at::Tensor flat = buf.view({-1});
    path.broadcast(flat, src);
    if (!buf.is_same(tensor)) tensor.copy_(buf);
    result = tensor;
    return true;
  }
  c10::intrusive_ptr<c10d::Work> issue(const ProcessGroup::Impl& g) {
    buf = tensor.is_contiguous() ? tensor : tensor.contiguous();
    std::vector<at::Tensor> bufs{as_gloo_dtype(buf)};
    c10d::BroadcastOptions opts;
    opts.rootRank = src;
    return issue_on_backend(g, buf, [&](compat::Backend& b) { return b.broadcast(bufs, opts); });
  }
  auto then() {
    return [tensor = tensor, buf = buf]() mutable {
      if (!buf.is_same(tensor)) tensor.copy_(buf);
      return tensor;
    };
  }
};

struct BarrierCall {
  static constexpr CollectiveType kType = CollectiveType::Barrier;
  static constexpr const char* kWhat = "barrier";
  static constexpr bool kKeepsResult = false, kHasLocalPath = true, kAsyncLocal = true;
  int size;
  at::Tensor none;  // no tensor: Gloo carries it

  at::Tensor* in_place() { return nullptr; }
  const at::Tensor& carrier() const { return none; }
  at::Tensor one_rank() { return {}; }
  WireContract contract() const {
    return {kWhat, "barrier", at::kByte, std::vector<int64_t>(size, 0), std::vector<int64_t>(size, 0)};
  }
  bool empty() const { return false; }
  at::Tensor empty_result() { return {}; }
  int64_t bytes() const { return 0; }
  int64_t local_bytes() const { return 0; }
  bool local(LocalPath& path, at::Tensor&) {
    path.barrier();
    return true;
  }
  c10::intrusive_ptr<c10d::Work> issue(const ProcessGroup::Impl& g) {
    return issue_on_backend(g, none, [](compat::Backend& b) { return b.barrier(); });
  }
  auto then() {
    return [] { return at::Tensor(); };
  }
};

}  // namespace dtp::detail
