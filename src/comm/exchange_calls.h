// The call types (NOTE: [Collective pipeline]) of the collectives that
// exchange pieces between ranks: all_to_all, all_to_all_single and scatter,
// over c10d's all_to_all with per-peer counts (all_to_all_flat); all_to_all_single
// also through shared memory (NOTE: [Shared-memory all_to_all]). Helpers in
// collective_calls.h.
#pragma once

#include "comm/collective_calls.h"

namespace dtp::detail {

// Piece q along `split_dim` to rank q; rank r's piece lands at its place
// along `cat_dim`. c10d only.
struct AllToAllCall {
  static constexpr CollectiveType kType = CollectiveType::AllToAll;
  static constexpr const char* kWhat = "all_to_all";
  static constexpr bool kKeepsResult = true, kHasLocalPath = false;
  const at::Tensor& input;
  int64_t split_dim;
  const std::vector<int64_t>& split_sizes;
  int64_t cat_dim;
  const std::vector<int64_t>& cat_sizes;
  int me, size;
  std::vector<int64_t> in_counts, out_counts;
  std::vector<std::vector<int64_t>> recv_shapes;  // rank r's piece, split_dim in front
  at::Tensor out;

  AllToAllCall(const at::Tensor& input, int64_t split_dim, const std::vector<int64_t>& split_sizes, int64_t cat_dim,
               const std::vector<int64_t>& cat_sizes, int me, int size)
      : input(input), split_dim(split_dim), split_sizes(split_sizes), cat_dim(cat_dim), cat_sizes(cat_sizes), me(me),
        size(size) {
    if (size == 1) return;
    const int64_t in_inner = numel_of(front_shape(input, split_dim, 1));
    for (int r = 0; r < size; ++r) {
      in_counts.push_back(split_sizes[r] * in_inner);
      recv_shapes.push_back(front_shape(input, split_dim, split_sizes[me], cat_dim, cat_sizes[r]));
      out_counts.push_back(numel_of(recv_shapes.back()));
    }
  }
  at::Tensor* in_place() { return nullptr; }
  const at::Tensor& carrier() const { return input; }
  at::Tensor one_rank() { return input; }
  WireContract contract() const {
    return {kWhat,
            c10::str("all_to_all of ", shape_text(input), " split along dim ", split_dim, " by ",
                     list_text(split_sizes),
                     ", gathered along dim ", cat_dim, " by ", list_text(cat_sizes)),
            input.scalar_type(), in_counts, out_counts};
  }
  bool empty() const {
    int64_t rest = 1;  // elements per (split, cat) pair: the same on every rank
    for (int64_t d = 0; d < input.dim(); ++d)
      if (d != split_dim && d != cat_dim) rest *= input.size(d);
    const int64_t split_total = std::accumulate(split_sizes.begin(), split_sizes.end(), int64_t{0});
    const int64_t cat_total = std::accumulate(cat_sizes.begin(), cat_sizes.end(), int64_t{0});
    return rest * split_total * cat_total == 0;
  }
  at::Tensor empty_result() {
    auto shape = input.sizes().vec();
    shape[split_dim] = split_sizes[me];
    shape[cat_dim] = std::accumulate(cat_sizes.begin(), cat_sizes.end(), int64_t{0});
    return at::empty(shape, input.options());
  }
  int64_t bytes() const { return nbytes(input); }
  c10::intrusive_ptr<c10d::Work> issue(const ProcessGroup::Impl& g) {
    at::Tensor in = input.movedim(split_dim, 0).contiguous().view({-1});
    out = at::empty({std::accumulate(out_counts.begin(), out_counts.end(), int64_t{0})}, input.options());
    return all_to_all_flat(g, out, in, out_counts, in_counts);
  }
  auto then() {
    return [out = out, out_counts = out_counts, recv_shapes = recv_shapes, split_dim = split_dim, cat_dim = cat_dim] {
      std::vector<at::Tensor> pieces;
      int64_t offset = 0;
      for (size_t r = 0; r < out_counts.size(); ++r) {
        pieces.push_back(out.narrow(0, offset, out_counts[r]).view(recv_shapes[r]).movedim(0, split_dim));
        offset += out_counts[r];
      }
      return at::cat(pieces, cat_dim);
    };
  }
};

// Rows along dim 0, per-rank counts that differ between ranks. Every rank
// takes part, also one that sends and receives nothing: the others cannot
// know (their split sizes are theirs), so it is never skipped as empty.
struct AllToAllSingleCall {
  static constexpr CollectiveType kType = CollectiveType::AllToAll;
  static constexpr const char* kWhat = "all_to_all_single";
  // Not kAsyncLocal: its path may decline (NOTE: [Async collectives on a LocalPath]).
  static constexpr bool kKeepsResult = true, kHasLocalPath = true, kAsyncLocal = false;
  const at::Tensor& input;
  const std::vector<int64_t>& output_split_sizes;
  const std::vector<int64_t>& input_split_sizes;
  int me, size;
  std::vector<int64_t> in_counts, out_counts;  // elements
  at::Tensor out;

  AllToAllSingleCall(const at::Tensor& input, const std::vector<int64_t>& output_split_sizes,
                     const std::vector<int64_t>& input_split_sizes, int me, int size)
      : input(input), output_split_sizes(output_split_sizes), input_split_sizes(input_split_sizes), me(me),
        size(size) {
    if (size == 1) return;
    const int64_t row = numel_of(front_shape(input, 0, 1));
    for (int r = 0; r < size; ++r) {
      in_counts.push_back(input_split_sizes[r] * row);
      out_counts.push_back(output_split_sizes[r] * row);
    }
  }
  at::Tensor* in_place() { return nullptr; }
  const at::Tensor& carrier() const { return input; }
  at::Tensor one_rank() { return input; }
  WireContract contract() const {
    return {kWhat,
            c10::str("all_to_all_single of ", shape_text(input), " on rank ", me, ": send ",
                     list_text(input_split_sizes), " rows, receive ", list_text(output_split_sizes)),
            input.scalar_type(), in_counts, out_counts};
  }
  bool empty() const { return false; }
  at::Tensor empty_result() { return input; }
  int64_t bytes() const { return nbytes(input); }
  // Always offered: the counts differ between ranks, so the path itself
  // decides, alike everywhere (NOTE: [Shared-memory all_to_all]).
  int64_t local_bytes() const { return 0; }
  bool local(LocalPath& path, at::Tensor& result) {
    at::Tensor o = at::empty(outShape(), input.options());
    at::Tensor flat = o.view({-1});
    if (!path.all_to_all(input.contiguous().view({-1}), in_counts, out_counts, flat)) return false;
    result = o;
    return true;
  }
  std::vector<int64_t> outShape() const {
    return chunk_shape(input, 0, std::accumulate(output_split_sizes.begin(), output_split_sizes.end(), int64_t{0}));
  }
  c10::intrusive_ptr<c10d::Work> issue(const ProcessGroup::Impl& g) {
    out = at::empty(chunk_shape(input, 0, std::accumulate(output_split_sizes.begin(), output_split_sizes.end(),
                                                         int64_t{0})),
                    input.options());
    at::Tensor in = input.contiguous().view({-1}), flat = out.view({-1});
    return all_to_all_flat(g, flat, in, out_counts, in_counts);
  }
  auto then() {
    return [out = out] { return out; };
  }
};

// Scatter as an all_to_all in which only `src` sends: exact sizes, no
// padding. c10d only.
struct ScatterCall {
  static constexpr CollectiveType kType = CollectiveType::Scatter;
  static constexpr const char* kWhat = "scatter";
  static constexpr bool kKeepsResult = true, kHasLocalPath = false;
  at::Tensor output;  // in place
  const std::vector<at::Tensor>& chunks;
  int src, me, size;
  at::Tensor out;  // `output`, or a contiguous one to copy from

  std::vector<int64_t> inCounts() const {
    std::vector<int64_t> counts(size, 0);
    if (me == src)
      for (int r = 0; r < size; ++r) counts[r] = chunks[r].numel();
    return counts;
  }
  std::vector<int64_t> outCounts() const {
    std::vector<int64_t> counts(size, 0);
    counts[src] = output.numel();
    return counts;
  }
  at::Tensor* in_place() { return &output; }
  const at::Tensor& carrier() const { return output; }
  at::Tensor one_rank() { return output.copy_(chunks[0]); }
  WireContract contract() const {
    return {kWhat, c10::str("scatter from rank ", src, " into ", shape_text(output)), output.scalar_type(), inCounts(),
            outCounts()};
  }
  bool empty() const { return false; }
  at::Tensor empty_result() { return output; }
  int64_t bytes() const {
    int64_t sent = 0;
    if (me == src)
      for (const auto& c : chunks) sent += nbytes(c);
    return sent;
  }
  c10::intrusive_ptr<c10d::Work> issue(const ProcessGroup::Impl& g) {
    at::Tensor in;
    if (me == src) {
      std::vector<at::Tensor> flat;
      for (int r = 0; r < size; ++r) flat.push_back(chunks[r].to(output.options()).contiguous().view({-1}));
      in = at::cat(flat);
    } else {
      in = at::empty({0}, output.options());
    }
    out = output.is_contiguous() ? output : at::empty(output.sizes(), output.options());
    at::Tensor out_flat = out.view({-1});
    return all_to_all_flat(g, out_flat, in, outCounts(), inCounts());
  }
  auto then() {
    return [output = output, out = out]() mutable {
      if (!out.is_same(output)) output.copy_(out);
      return output;
    };
  }
};

}  // namespace dtp::detail
