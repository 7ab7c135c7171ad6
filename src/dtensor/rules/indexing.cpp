// Indexing with masks and index tensors: index_put of a scalar, masked_select
// and masked_scatter, gather and scatter_add (what cross_entropy's label
// smoothing and their backwards run).
#include "dtensor/dtensor_impl.h"
#include "dtensor/redistribute.h"
#include "dtensor/rules/common.h"

#include <ATen/ATen.h>

namespace dtp {
namespace {

// masked_scatter(self, mask, source) (masked_select's backward): source's
// elements fill self's masked places in order, so no dim can be sharded. It
// is linear in (self, source) with a replicated mask:
// (a0+a1) scattered with (s0+s1) = a0 scattered with s0 + a1 with s1.
std::vector<Row> maskedScatterRows(const OpCall& c, int64_t m) {
  std::vector<Row> rows{rules::replicate_row(c)};
  if (c.specs.size() == 3) {
    const Placement p = rules::linear_partial(c, m);
    rows.push_back(Row{{p, Replicate(), p}, {p}});
  }
  return rows;
}

// gather(self, dim, index): out[.., i, ..] = self[.., index[.., i, ..], ..]
// along `dim`; the output has index's shape. With self replicated, index may
// be sharded along `dim` itself (other dims would pair a local index column
// with self's global one).
std::vector<Row> gatherRows(const OpCall& c, int64_t) {
  std::vector<Row> rows{rules::replicate_row(c)};
  if (c.specs.size() == 2 && c.slot_of_arg(0) == 0) {
    const int64_t dim = c10::maybe_wrap_dim(c.arg_int(1), c.spec(1).ndim());
    rows.push_back(Row{{Replicate(), Shard(dim)}, {Shard(dim)}});
  }
  return rows;
}

// scatter_add(self, dim, index, src) (gather's backward) adds src into self
// at index along `dim`: linear in (self, src). Index and src sharded alike
// along `dim` add disjoint parts, so self must be a Partial (the replicated
// zeros of a backward become P(sum) locally, without communication).
std::vector<Row> scatterAddRows(const OpCall& c, int64_t m) {
  std::vector<Row> rows{rules::replicate_row(c)};
  if (c.specs.size() == 3) {
    const int64_t dim = c10::maybe_wrap_dim(c.arg_int(1), c.spec(0).ndim());
    const Placement p = rules::linear_partial(c, m);
    rows.push_back(Row{{p, Shard(dim), Shard(dim)}, {p}});
    rows.push_back(Row{{p, Replicate(), p}, {p}});
  }
  return rows;
}


// index_select(self, dim, index), index 1-D: a shard of self on another dim
// stays; with self replicated, an index sharded along its one dim picks each
// rank's chunk of the output along `dim`.
std::vector<Row> indexSelectRows(const OpCall& c, int64_t) {
  std::vector<Row> rows{rules::replicate_row(c)};
  if (c.specs.size() == 2 && c.slot_of_arg(0) == 0) {
    const int64_t nd = c.spec(0).ndim(), dim = c10::maybe_wrap_dim(c.arg_int(1), nd);
    for (int64_t d = 0; d < nd; ++d)
      if (d != dim) rows.push_back(Row{{Shard(d), Replicate()}, {Shard(d)}});
    rows.push_back(Row{{Replicate(), Shard(0)}, {Shard(dim)}});
  }
  return rows;
}

OutputMeta indexSelectShape(const OpCall& c) {
  std::vector<int64_t> shape = c.spec(0).shape;
  shape[c10::maybe_wrap_dim(c.arg_int(1), c.spec(0).ndim())] = c.spec(1).numel();
  return OutputMeta{{shape}, {c.spec(0).dtype}};
}

// index_add(self, dim, index, source) (index_select's backward) is linear in
// (self, source): shards on another dim stay, partial sums stay partial, and
// an index sharded with source's rows adds disjoint parts into a Partial.
std::vector<Row> indexAddRows(const OpCall& c, int64_t m) {
  std::vector<Row> rows{rules::replicate_row(c)};
  if (c.specs.size() == 3) {
    const int64_t nd = c.spec(0).ndim(), dim = c10::maybe_wrap_dim(c.arg_int(1), nd);
    for (int64_t d = 0; d < nd; ++d)
      if (d != dim) rows.push_back(Row{{Shard(d), Replicate(), Shard(d)}, {Shard(d)}});
    const Placement p = rules::linear_partial(c, m);
    rows.push_back(Row{{p, Replicate(), p}, {p}});
    rows.push_back(Row{{p, Shard(0), Shard(dim)}, {p}});
  }
  return rows;
}

// index_put(_)(self, indices, values, accumulate) writing one scalar into a
// replicated or partial tensor through replicated indices (cross_entropy's
// label smoothing zeroes ignored rows this way). Zeros keep partial sums
// exact; anything else on a Partial tensor, or sharded operands, go to the
// rules (and fail there with the usual message).
bool indexPutScalar(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 4);
  at::Tensor self = args[0].toTensor();
  auto* impl = maybeGetDTensorImpl(self);
  const at::Tensor values = args[2].toTensor();
  if (impl == nullptr || isDTensor(values) || values.dim() != 0 || args[3].toBool()) return false;
  bool partial = false;
  for (const auto& p : impl->spec().placements) {
    if (p.is_shard() || (p.is_partial() && p.op != ReduceOp::Sum)) return false;
    partial |= p.is_partial();
  }
  if (partial && values.item<double>() != 0.0) return false;
  c10::List<c10::optional<at::Tensor>> local_indices;
  for (const c10::optional<at::Tensor>& i : args[1].toOptionalTensorList()) {
    if (i.has_value() && isDTensor(*i)) {
      auto* ii = unsafeGetDTensorImpl(*i);
      if (!ii->spec().is_replicated()) return false;
      local_indices.push_back(ii->local());
    } else {
      local_indices.push_back(i);
    }
  }
  at::Tensor local = impl->local();
  torch::jit::drop(*stack, 4);
  torch::jit::push(*stack, local, local_indices, values, /*accumulate=*/false);
  op.callBoxed(stack);
  if (op.schema().is_mutable()) {
    torch::jit::drop(*stack, 1);
    stack->emplace_back(self);
  } else {
    stack->back() = makeDTensor(stack->back().toTensor(), impl->spec_ptr());
  }
  return true;
}

// masked_select(self, mask) on a replicated or Partial(sum/avg) self with a
// replicated mask (libtorch 1.13's cross_entropy takes the mean of label
// smoothing's per-row losses this way). Selecting is linear and the mask is
// the same on every rank, so the output keeps self's placements; its length
// depends on the data, so no rule (whose shapes come from meta tensors) can
// describe it. Sharded operands go to the rules, which have none: a clear error.
bool maskedSelectReplicatedMask(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 2);
  auto* impl = maybeGetDTensorImpl(args[0].toTensor());
  at::Tensor mask = args[1].toTensor();
  if (impl == nullptr) return false;
  for (const auto& p : impl->spec().placements)
    if (p.is_shard() || (p.is_partial() && p.op != ReduceOp::Sum && p.op != ReduceOp::Avg)) return false;
  if (auto* m = maybeGetDTensorImpl(mask)) {
    if (!m->spec().is_replicated() || !(m->spec().mesh == impl->spec().mesh)) return false;
    mask = m->local();
  }
  at::Tensor out = at::masked_select(impl->local(), mask);
  auto spec = make_spec(impl->spec().mesh, impl->spec().placements, out.sizes().vec(), out.scalar_type());
  torch::jit::drop(*stack, 2);
  stack->emplace_back(makeDTensor(std::move(out), std::move(spec)));
  return true;
}

}  // namespace

void registerIndexingRules(RuleRegistry& r) {
  r.add_handler("aten::index_put_", indexPutScalar);
  r.add_handler("aten::index_put", indexPutScalar);
  r.add_handler("aten::masked_select", maskedSelectReplicatedMask);
  r.add("aten::masked_scatter_", maskedScatterRows, rules::self_shape);
  r.add("aten::masked_scatter", maskedScatterRows, rules::self_shape);
  r.add("aten::gather", gatherRows);
  r.add("aten::scatter_add", scatterAddRows);
  r.add("aten::scatter_add_", scatterAddRows);
  r.add("aten::index_select", indexSelectRows, indexSelectShape);
  r.add("aten::index_add", indexAddRows, rules::self_shape);
  r.add("aten::index_add_", indexAddRows, rules::self_shape);
}

}  // namespace dtp
