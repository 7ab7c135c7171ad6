// Reductions and softmax: a shard on a reduced dim becomes a Partial of the
// matching op; a shard on a kept dim stays (shifted when the dim is dropped).
#include "comm/compat.h"
#include "dtensor/rules/common.h"

#include <set>

namespace dtp {
namespace {

enum class Reduce { Sum, Mean, Max, Min, Norm };

// Dims reduced by the call: argument `dim_arg` (int[] or None: all).
std::set<int64_t> reducedDims(const OpCall& c, int dim_arg) {
  const int64_t nd = c.spec(0).ndim();
  std::set<int64_t> dims;
  if (dim_arg < 0 || dim_arg >= static_cast<int>(c.args.size()) || c.args[dim_arg].isNone() ||
      (c.args[dim_arg].isIntList() && c.args[dim_arg].toIntList().empty())) {
    for (int64_t d = 0; d < nd; ++d) dims.insert(d);
  } else if (c.args[dim_arg].isInt()) {
    dims.insert(c.args[dim_arg].toInt() < 0 ? c.args[dim_arg].toInt() + nd : c.args[dim_arg].toInt());
  } else {
    for (int64_t d : c.args[dim_arg].toIntList()) dims.insert(d < 0 ? d + nd : d);
  }
  return dims;
}

// Argument `keepdim_arg` when given and true.
bool keepdimOf(const OpCall& c, int keepdim_arg) {
  return keepdim_arg >= 0 && keepdim_arg < static_cast<int>(c.args.size()) && c.args[keepdim_arg].isBool() &&
         c.args[keepdim_arg].toBool();
}

// Where kept input dim `d` lands in the output.
int64_t outputDim(int64_t d, const std::set<int64_t>& reduced, bool keepdim) {
  if (!keepdim)
    for (int64_t r : reduced) d -= r < d;
  return d;
}

StrategyFn reduction(Reduce kind, int dim_arg, int keepdim_arg) {
  return [=](const OpCall& c, int64_t m) {
    std::vector<Row> rows{rules::replicate_row(c)};
    const auto dims = reducedDims(c, dim_arg);
    const bool keepdim = keepdimOf(c, keepdim_arg);
    const auto& shape = c.spec(0).shape;
    for (int64_t d = 0; d < c.spec(0).ndim(); ++d) {
      if (dims.count(d)) {
        const int64_t w = rules::shardCount(c, 0, d, m);
        Placement out;
        switch (kind) {
          case Reduce::Sum: out = Partial(ReduceOp::Sum); break;
          // Local means average correctly only over equal-sized shards.
          case Reduce::Mean:
            if (shape[d] % w != 0) continue;
            out = Partial(ReduceOp::Avg);
            break;
          // max/min of an empty shard is an error: only when no shard is empty.
          case Reduce::Max:
          case Reduce::Min:
            if (chunk_size(shape[d], w, w - 1) == 0) continue;
            out = Partial(kind == Reduce::Max ? ReduceOp::Max : ReduceOp::Min);
            break;
          case Reduce::Norm: continue;  // NYI: a norm Partial; gathers instead
        }
        rows.push_back(Row{{Shard(d)}, {out}});
      } else {
        rows.push_back(Row{{Shard(d)}, {Shard(outputDim(d, dims, keepdim))}});
      }
    }
    // sum and mean are linear; max of P(max) pieces is P(max), likewise min.
    const Placement cur = c.spec(0).placements[m];
    if ((kind == Reduce::Sum || kind == Reduce::Mean) && cur.is_partial() &&
        (cur.op == ReduceOp::Sum || cur.op == ReduceOp::Avg)) {
      rows.push_back(Row{{cur}, {cur}});
    }
    if ((kind == Reduce::Max && cur == Partial(ReduceOp::Max)) ||
        (kind == Reduce::Min && cur == Partial(ReduceOp::Min))) {
      rows.push_back(Row{{cur}, {cur}});
    }
    return rows;
  };
}

// softmax-like ops along `dim`: shards on other dims stay; all slots alike.
StrategyFn alongDim(int dim_arg) {
  return [=](const OpCall& c, int64_t) {
    std::vector<Row> rows{rules::replicate_row(c)};
    const int64_t nd = c.spec(0).ndim();
    int64_t dim = c.arg_int(dim_arg);
    if (dim < 0) dim += nd;
    for (int64_t d = 0; d < nd; ++d) {
      if (d != dim)
        rows.push_back(Row{Placements(c.specs.size(), Shard(d)), Placements(c.num_outputs, Shard(d))});
    }
    return rows;
  };
}

// Reductions whose pieces do not combine (argmax, var, max with indices): a
// shard on a kept dim stays on every output (shifted when dims are dropped);
// one on a reduced dim is gathered first.
StrategyFn keptDims(int dim_arg, int keepdim_arg) {
  return [=](const OpCall& c, int64_t) {
    std::vector<Row> rows{rules::replicate_row(c)};
    const auto dims = reducedDims(c, dim_arg);
    const bool keepdim = keepdimOf(c, keepdim_arg);
    for (int64_t d = 0; d < c.spec(0).ndim(); ++d) {
      if (!dims.count(d)) rows.push_back(Row{{Shard(d)}, Placements(c.num_outputs, Shard(outputDim(d, dims, keepdim)))});
    }
    return rows;
  };
}

// Output shapes where libtorch 1.13 has no meta kernel: the input's with the
// reduced dims dropped or kept as 1 (var, std; flip: rules::self_shape).

ShapeFn reducedShape(int dim_arg, int keepdim_arg) {
  return [=](const OpCall& c) {
    const auto dims = reducedDims(c, dim_arg);
    const bool keepdim = keepdimOf(c, keepdim_arg);
    std::vector<int64_t> shape;
    for (int64_t d = 0; d < c.spec(0).ndim(); ++d) {
      if (!dims.count(d)) shape.push_back(c.spec(0).shape[d]);
      else if (keepdim) shape.push_back(1);
    }
    const size_t n = c.op.schema().returns().size();  // var: 1; var_mean: 2, alike
    return OutputMeta{std::vector<std::vector<int64_t>>(n, shape), std::vector<c10::ScalarType>(n, c.spec(0).dtype)};
  };
}

// flip(dims): shards on the other dims stay.
std::vector<Row> flipRows(const OpCall& c, int64_t) {
  std::vector<Row> rows{rules::replicate_row(c)};
  const auto dims = reducedDims(c, 1);
  for (int64_t d = 0; d < c.spec(0).ndim(); ++d)
    if (!dims.count(d)) rows.push_back(Row{{Shard(d)}, {Shard(d)}});
  return rows;
}

}  // namespace

void registerReductionRules(RuleRegistry& r) {
  r.add("aten::max.dim", keptDims(1, 2));
  r.add("aten::min.dim", keptDims(1, 2));
  r.add("aten::argmax", keptDims(1, 2));
  r.add("aten::argmin", keptDims(1, 2));
  r.add("aten::var.correction", keptDims(1, 3), reducedShape(1, 3));
  r.add("aten::std.correction", keptDims(1, 3), reducedShape(1, 3));
  r.add("aten::var_mean.correction", keptDims(1, 3), reducedShape(1, 3));
  r.add("aten::std_mean.correction", keptDims(1, 3), reducedShape(1, 3));
  r.add("aten::cumsum", alongDim(1));
  r.add("aten::cumprod", alongDim(1));
  r.add("aten::sort", alongDim(1));
  r.add("aten::sort.stable", alongDim(2));
  r.add("aten::topk", alongDim(2));
  r.add("aten::flip", flipRows, rules::self_shape);
  r.add("aten::sum", reduction(Reduce::Sum, -1, -1));
  r.add("aten::sum.dim_IntList", reduction(Reduce::Sum, 1, 2));
  r.add("aten::mean", reduction(Reduce::Mean, -1, -1));
  r.add("aten::mean.dim", reduction(Reduce::Mean, 1, 2));
  r.add("aten::amax", reduction(Reduce::Max, 1, 2));
  r.add("aten::amin", reduction(Reduce::Min, 1, 2));
  // No Meta kernel for max() and min() in libtorch 1.13: 0-dim outputs.
  r.add("aten::max", reduction(Reduce::Max, -1, -1), reducedShape(-1, -1));
  r.add("aten::min", reduction(Reduce::Min, -1, -1), reducedShape(-1, -1));
  r.add("aten::linalg_vector_norm", reduction(Reduce::Norm, 2, 3));
  r.add("aten::norm.Scalar", reduction(Reduce::Norm, -1, -1));
  r.add("aten::norm.ScalarOpt_dim", reduction(Reduce::Norm, 2, 3));
  r.add("aten::_softmax", alongDim(1));
  r.add("aten::_log_softmax", alongDim(1));
#if DTP_HAS_SAFE_SOFTMAX
  r.add("aten::_safe_softmax", alongDim(1), rules::self_shape);  // scaled_dot_product_attention's math path (no Meta kernel)
#endif
  r.add("aten::_softmax_backward_data", alongDim(2));
  r.add("aten::_log_softmax_backward_data", alongDim(2));
}

}  // namespace dtp
