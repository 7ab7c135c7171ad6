// Norms and losses: reductions whose result is not a plain sum of shards.
#include "dtensor/redistribute.h"
#include "dtensor/rules/common.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

namespace dtp {
namespace {

// norm over all elements (norm.Scalar, linalg_vector_norm with dim=None) of
// a sharded tensor: each rank reduces its shard to sum(|x|^p) (max|x| for
// p=inf), one all_reduce per sharded mesh dim combines them, then ^(1/p).
// Moves one scalar instead of gathering the tensor (gradient clipping calls
// this on every gradient). Calls with dims go to the reduction rule.
bool fullNorm(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  auto args = torch::jit::last(*stack, nargs);
  const bool vector_norm = schema.name() == "aten::linalg_vector_norm";
  if (vector_norm && !args[2].isNone() && !args[2].toIntList().empty()) return false;
  auto* impl = unsafeGetDTensorImpl(args[0].toTensor());
  const DTensorSpec& spec = impl->spec();
  bool sharded = false;
  for (const auto& p : spec.placements) sharded |= p.is_shard();
  if (!sharded) return false;

  const double p = args[1].isNone() ? 2.0 : args[1].toScalar().toDouble();
  const bool keepdim = vector_norm && args[3].toBool();
  auto dtype = vector_norm ? args[4].toOptional<at::ScalarType>() : c10::nullopt;
  Placements target = spec.placements;
  for (auto& pl : target)
    if (pl.is_partial()) pl = Replicate();
  at::Tensor local = redistribute_local(impl->local(), spec, target).to(dtype.value_or(spec.dtype));
  at::Tensor a = local.abs();
  const bool inf = std::isinf(p);
  at::Tensor v;
  ReduceOp combine = ReduceOp::Sum;
  if (inf) {
    combine = p > 0 ? ReduceOp::Max : ReduceOp::Min;
    const double identity = p > 0 ? 0.0 : std::numeric_limits<double>::infinity();
    v = a.numel() == 0 ? at::scalar_tensor(identity, a.options()) : (p > 0 ? a.amax() : a.amin());
  } else if (p == 0) {
    v = a.ne(0).sum().to(a.scalar_type());
  } else {
    v = a.pow(p).sum();
  }
  for (size_t m = 0; m < target.size(); ++m) {
    if (target[m].is_shard()) spec.mesh.get_group(m).all_reduce(v, combine);
  }
  if (!inf && p != 0) v = v.pow(1.0 / p);
  std::vector<int64_t> shape = keepdim ? std::vector<int64_t>(spec.ndim(), 1) : std::vector<int64_t>{};
  v = v.reshape(shape);
  torch::jit::drop(*stack, nargs);
  stack->emplace_back(makeDTensor(v, make_spec(spec.mesh, Placements(target.size(), Replicate()),
                                               shape, v.scalar_type())));
  return true;
}

// A row from placements per argument index (R for the other slots).
Row byArg(const OpCall& c, std::initializer_list<std::pair<int, Placement>> in, Placements out) {
  Row r{Placements(c.specs.size(), Replicate()), std::move(out)};
  for (const auto& [arg, p] : in) {
    int s = c.slot_of_arg(arg);
    if (s >= 0) r.in[s] = p;
  }
  return r;
}

enum Reduction { kNone = 0, kMean = 1, kSum = 2 };

// nll_loss_forward(self[N,C], target[N], weight?, reduction, ignore_index)
// -> (output, total_weight). Batch-sharded: per-sample losses stay sharded
// (none) or sum to P(sum); a mean needs the global total weight, so it
// gathers. Class-sharded logits are loss_parallel's business.
std::vector<Row> nllLossRows(const OpCall& c, int64_t) {
  std::vector<Row> rows{rules::replicate_row(c)};
  const int64_t reduction = c.arg_int(3);
  if (c.spec(0).ndim() == 2 && reduction != kMean) {
    Placements out = reduction == kNone ? Placements{Shard(0), Replicate()}
                                        : Placements{Partial(), Partial()};
    rows.push_back(byArg(c, {{0, Shard(0)}, {1, Shard(0)}}, out));
  }
  return rows;
}

// nll_loss_backward(grad_out, self, target, weight?, reduction, ignore_index,
// total_weight): with the global total weight replicated, each rank's rows of
// the gradient only need its own samples.
std::vector<Row> nllLossBackwardRows(const OpCall& c, int64_t) {
  std::vector<Row> rows{rules::replicate_row(c)};
  if (c.spec(1).ndim() == 2) {
    const Placement g = c.arg_int(4) == kNone ? Shard(0) : Replicate();
    rows.push_back(byArg(c, {{0, g}, {1, Shard(0)}, {2, Shard(0)}}, {Shard(0)}));
  }
  return rows;
}

}  // namespace

void registerLossRules(RuleRegistry& r) {
  r.add_handler("aten::norm.Scalar", fullNorm);
  r.add_handler("aten::linalg_vector_norm", fullNorm);
  r.add("aten::nll_loss_forward", nllLossRows);
  r.add("aten::nll_loss_backward", nllLossBackwardRows);
  // loss_parallel (src/tp) owns the handlers for class-sharded logits; the
  // core carries only how to reach them, as data for its errors.
  for (const char* op : {"aten::nll_loss_forward", "aten::nll_loss2d_forward"})
    r.add_hint(op, "For logits sharded on the class dim, compute the loss inside dtp::LossParallelGuard "
                   "or with dtp::loss_parallel_cross_entropy.");
  for (const char* op : {"aten::nll_loss_backward", "aten::nll_loss2d_backward"})
    r.add_hint(op, "A loss computed under dtp::LossParallelGuard saves plain targets for backward: run "
                   "backward inside the guard too, or use dtp::loss_parallel_cross_entropy.");
}

}  // namespace dtp
