// Neural-network ops with rules of their own: embedding (row-, column- and
// batch-sharded) and its backward, layer norm and group norm and their
// backwards.
#include "dtensor/dtensor_impl.h"
#include "dtensor/redistribute.h"
#include "dtensor/rules/common.h"
#include "dtensor/spec_facts.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace dtp {
namespace {

// embedding(weight[V,D], indices): shard D (colwise), shard the indices'
// batch dims, or shard V (rowwise): each rank looks up its rows and the
// output is MaskPartial (NOTE: [MaskPartial]), as PyTorch's rowwise row.
// See maskedEmbedding.
std::vector<Row> embeddingRows(const OpCall& c, int64_t) {
  std::vector<Row> rows{rules::replicate_row(c)};
  const int64_t idx_nd = c.spec(1).ndim();
  rows.push_back(Row{{Shard(1), Replicate()}, {Shard(idx_nd)}});
  for (int64_t d = 0; d < idx_nd; ++d) rows.push_back(Row{{Replicate(), Shard(d)}, {Shard(d)}});
  rows.push_back(Row{{Shard(0), Replicate()}, {MaskPartial(c.spec(0).shape[0])}});
  return rows;
}

// No meta kernel for index_select in libtorch 1.13: indices.shape + [D].
OutputMeta embeddingShape(const OpCall& c) {
  auto shape = c.spec(1).shape;
  shape.push_back(c.spec(0).shape[1]);
  return OutputMeta{{shape}, {c.spec(0).dtype}};
}

// Indices of rows [start, start + rows) made local; the others become `fill`.
// Also returns where they were outside.
std::pair<at::Tensor, at::Tensor> localRowIndices(const at::Tensor& indices, int64_t start, int64_t rows,
                                                  int64_t fill) {
  at::Tensor outside = (indices < start).logical_or_(indices >= start + rows);
  return {(indices - start).masked_fill_(outside, fill), outside};
}

// The rows [start, start + rows) of the weight this rank holds, from a spec
// sharding dim 0 (with any mix of mesh dims).
std::pair<int64_t, int64_t> localRows(const DTensorSpec& s) { return {s.local_offset()[0], s.local_sizes[0]}; }

// The vocabulary-sharded lookup: each rank looks its ids up in its rows
// (another rank's id reads local row 0) and leaves the masking to the
// reduction, which zeros the positions its output's mask marks
// (NOTE: [MaskPartial]). The output carries that mask in its spec.
void maskedEmbedding(const c10::OperatorHandle& op, torch::jit::Stack* stack, const Decision& d) {
  const auto& wspec = *d.in_specs[0];
  bool vocab_sharded = false;
  for (const auto& p : wspec.placements) vocab_sharded |= p.is_shard(0);
  if (!vocab_sharded) {
    op.callBoxed(stack);
    return;
  }
  const size_t nargs = op.schema().arguments().size();
  auto args = torch::jit::last(*stack, nargs);
  at::Tensor weight = args[0].toTensor(), indices = args[1].toTensor();
  const auto [start, rows] = localRows(wspec);
  if (rows == wspec.shape[0]) {  // every row here (mesh dims of one rank): nothing to mask
    op.callBoxed(stack);
    return;
  }
  auto [local_idx, outside] = localRowIndices(indices, start, rows, 0);
  at::Tensor out;
  if (rows == 0) {
    // NOTE: [Empty vocabulary shard] f64[9,D](S(0)) on 4 ranks -> local
    // rows 3,3,3,0: the last rank has no row to look up (the lookup on a
    // [0, D] weight fails), every id is another rank's, and its part of the
    // output is zeros. Its gradient is its [0, D] shard (the backward below
    // narrows to local rows).
    auto shape = indices.sizes().vec();
    shape.push_back(weight.size(1));
    out = at::zeros(shape, weight.options());
  } else {
    out = at::embedding(weight, local_idx);
  }
  auto facts = std::make_shared<SpecFacts>();
  facts->mask = std::move(outside);
  torch::jit::drop(*stack, nargs);
  stack->emplace_back(makeDTensor(std::move(out), with_facts(d.out[0], std::move(facts))));
}

// embedding_dense_backward(grad[...,D], indices, num_weights, ...) -> [V,D].
// A MaskPartial gradient (the backward of the vocabulary-sharded lookup's
// reduction: NOTE: [MaskPartial]) with replicated indices gives the
// weight's rows of this rank, S(0), without communication.
std::vector<Row> embeddingBackwardRows(const OpCall& c, int64_t m) {
  std::vector<Row> rows{rules::replicate_row(c)};
  const int64_t nd = c.spec(0).ndim();
  rows.push_back(Row{{Shard(nd - 1), Replicate()}, {Shard(1)}});
  for (int64_t d = 0; d + 1 < nd; ++d) rows.push_back(Row{{Shard(d), Shard(d)}, {Partial()}});
  const Placement p = rules::linear_partial(c, m);
  rows.push_back(Row{{p, Replicate()}, {p}});
  const Placement& g = c.spec(0).placements[m];
  if (g == MaskPartial(c.arg_int(2))) rows.push_back(Row{{g, Replicate()}, {Shard(0)}});
  return rows;
}

OutputMeta embeddingBackwardShape(const OpCall& c) {
  return OutputMeta{{{c.arg_int(2), c.spec(0).shape.back()}}, {c.spec(0).dtype}};
}

// NOTE: [Vocab-sharded embedding backward]
// embedding_dense_backward sees only the gradient, the indices and V, so on
// its own it builds the whole [V, D] gradient on every rank (PyTorch does:
// its rule has no rowwise row), and the weight's S(0) then keeps this
// rank's rows: O(V) work and memory where O(V / tp) will do. The gradient
// says more: when it is MaskPartial over a table of V rows (the lookup's
// output was, NOTE: [MaskPartial]), the rule's S(0) row is taken and this
// rank computes only its rows: the ids of other ranks' rows go to a spare
// row past the end, which is dropped. The decided output spec says which
// rows are this rank's.
void embeddingBackwardLocal(const c10::OperatorHandle& op, torch::jit::Stack* stack, const Decision& d) {
  bool mask_partial = false;
  for (const auto& p : d.in[0]) mask_partial |= p.is_mask_partial();
  if (!mask_partial) {
    op.callBoxed(stack);
    return;
  }
  auto args = torch::jit::last(*stack, 5);
  const at::Tensor grad = args[0].toTensor(), indices = args[1].toTensor();
  const auto [start, rows] = localRows(*d.out[0]);
  const at::Tensor local_idx = localRowIndices(indices, start, rows, rows).first;
  const int64_t pad = args[3].toInt();
  const int64_t local_pad = pad >= start && pad < start + rows ? pad - start : -1;
  at::Tensor out = at::embedding_dense_backward(grad, local_idx, rows + 1, local_pad, args[4].toBool())
                       .narrow(0, 0, rows);
  torch::jit::drop(*stack, 5);
  stack->emplace_back(std::move(out));
}

// native_layer_norm(input, normalized_shape, weight?, bias?, eps): shards on
// the leading (not normalized) dims stay; weight and bias are replicated.
std::vector<Row> layerNormRows(const OpCall& c, int64_t) {
  std::vector<Row> rows{rules::replicate_row(c)};
  const int64_t lead = c.spec(0).ndim() - static_cast<int64_t>(c.args[1].toIntList().size());
  for (int64_t d = 0; d < lead; ++d) {
    Row r = rules::replicate_row(c);
    r.in[0] = Shard(d);
    r.out.assign(c.num_outputs, Shard(d));
    rows.push_back(r);
  }
  return rows;
}

// No meta kernels for layer norm in libtorch 1.13.
OutputMeta layerNormShape(const OpCall& c) {
  const auto& in = c.spec(0);
  const int64_t lead = in.ndim() - static_cast<int64_t>(c.args[1].toIntList().size());
  std::vector<int64_t> stat(in.shape.begin(), in.shape.begin() + lead);
  stat.resize(in.shape.size(), 1);
  return OutputMeta{{in.shape, stat, stat}, {in.dtype, in.dtype, in.dtype}};
}

OutputMeta layerNormBackwardShape(const OpCall& c) {
  OutputMeta m;
  auto mask = c.args[7].toBoolList();
  auto add = [&](int arg, bool want) {
    int s = c.slot_of_arg(arg);
    if (want && s >= 0) {
      m.shapes.push_back(c.spec(s).shape);
      m.dtypes.push_back(c.spec(s).dtype);
    } else {
      m.shapes.emplace_back();
      m.dtypes.push_back(c10::ScalarType::Undefined);
    }
  };
  add(1, mask.get(0));
  add(5, mask.get(1));
  add(6, mask.get(2));
  return m;
}

// native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd,
// weight?, bias?, mask) -> (grad_input, grad_weight, grad_bias): with the batch
// sharded, parameter gradients are sums over local rows: P(sum).
std::vector<Row> layerNormBackwardRows(const OpCall& c, int64_t) {
  std::vector<Row> rows{rules::replicate_row(c)};
  const int64_t lead = c.spec(1).ndim() - static_cast<int64_t>(c.args[2].toIntList().size());
  for (int64_t d = 0; d < lead; ++d) {
    Row r = rules::replicate_row(c);
    for (int a : {0, 1, 3, 4}) {
      int s = c.slot_of_arg(a);
      if (s >= 0) r.in[s] = Shard(d);
    }
    r.out = {Shard(d), Partial(), Partial()};
    rows.push_back(r);
  }
  return rows;
}

// native_group_norm(input [N, C, *], weight?, bias?, N, C, HxW, group, eps)
// -> (out, mean [N, group], rstd [N, group]): batch-sharded (each sample is
// normalized alone), or replicated.
std::vector<Row> groupNormRows(const OpCall& c, int64_t) {
  Row r = rules::replicate_row(c);
  r.in[0] = Shard(0);
  r.out.assign(c.num_outputs, Shard(0));
  return {rules::replicate_row(c), r};
}

OutputMeta groupNormShape(const OpCall& c) {
  const auto& in = c.spec(0);
  const std::vector<int64_t> stat{in.shape[0], c.arg_int(6)};
  return OutputMeta{{in.shape, stat, stat}, {in.dtype, in.dtype, in.dtype}};
}

// native_group_norm_backward(grad_out, input, mean, rstd, weight?, N, C,
// HxW, group, mask) -> (grad_input, grad_weight [C], grad_bias [C]): with
// the batch sharded, the parameter gradients are sums over local samples:
// P(sum).
std::vector<Row> groupNormBackwardRows(const OpCall& c, int64_t) {
  Row r = rules::replicate_row(c);
  for (int a : {0, 1, 2, 3}) {
    const int s = c.slot_of_arg(a);
    if (s >= 0) r.in[s] = Shard(0);
  }
  r.out = {Shard(0), Partial(), Partial()};
  return {rules::replicate_row(c), r};
}

OutputMeta groupNormBackwardShape(const OpCall& c) {
  const auto mask = c.args[9].toBoolList();
  const auto& in = c.spec(c.slot_of_arg(1));
  const std::vector<int64_t> param{in.shape[1]};
  OutputMeta m;
  for (size_t o = 0; o < 3; ++o) {
    m.shapes.push_back(!mask.get(o) ? std::vector<int64_t>{} : o == 0 ? in.shape : param);
    m.dtypes.push_back(mask.get(o) ? in.dtype : c10::ScalarType::Undefined);
  }
  return m;
}

// Group norm's N argument is the global batch: a shard runs with its own.
template <int kInput, int kN>
void withLocalBatch(const c10::OperatorHandle& op, torch::jit::Stack* stack, const Decision&) {
  c10::IValue* args = &*(stack->end() - static_cast<std::ptrdiff_t>(op.schema().arguments().size()));
  args[kN] = args[kInput].toTensor().size(0);
  op.callBoxed(stack);
}

}  // namespace

void registerNnOpRules(RuleRegistry& r) {
  r.add("aten::embedding", embeddingRows, embeddingShape, maskedEmbedding);
  r.add("aten::embedding_dense_backward", embeddingBackwardRows, embeddingBackwardShape, embeddingBackwardLocal);
  r.add("aten::native_layer_norm", layerNormRows, layerNormShape);
  r.add("aten::native_layer_norm_backward", layerNormBackwardRows, layerNormBackwardShape);
  r.add("aten::native_group_norm", groupNormRows, groupNormShape, withLocalBatch<0, 3>);
  r.add("aten::native_group_norm_backward", groupNormBackwardRows, groupNormBackwardShape, withLocalBatch<1, 5>);
}

}  // namespace dtp
