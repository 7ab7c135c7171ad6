// Matrix ops as einsum specs: "mk,kn->mn" shards any output letter, turns a
// sharded contraction letter into P(sum), and passes one Partial operand
// through (the product is linear in each operand).
#include "dtensor/local_linear.h"
#include "dtensor/rules/common.h"

namespace dtp {
namespace {

struct Einsum {
  std::vector<std::string> inputs;
  std::string output;
};

Einsum parseEinsum(const std::string& spec) {
  Einsum e;
  auto arrow = spec.find("->");
  std::string lhs = spec.substr(0, arrow);
  e.output = spec.substr(arrow + 2);
  size_t start = 0;
  while (true) {
    auto comma = lhs.find(',', start);
    e.inputs.push_back(lhs.substr(start, comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return e;
}

// Rows for the einsum operands, which are the slots from `first_slot` on;
// slots before it (a bias) are filled in by the caller.
std::vector<Row> einsumRows(const Einsum& e, size_t nslots, size_t first_slot, const Placement& partial) {
  std::vector<Row> rows;
  Row rep{Placements(nslots, Replicate()), Placements{Replicate()}};
  rows.push_back(rep);
  std::string letters;
  for (const auto& in : e.inputs)
    for (char c : in)
      if (letters.find(c) == std::string::npos) letters += c;
  for (char c : letters) {
    Row r = rep;
    for (size_t i = 0; i < e.inputs.size(); ++i) {
      auto pos = e.inputs[i].find(c);
      if (pos != std::string::npos) r.in[first_slot + i] = Shard(static_cast<int64_t>(pos));
    }
    auto opos = e.output.find(c);
    r.out[0] = opos == std::string::npos ? Partial(ReduceOp::Sum) : Shard(static_cast<int64_t>(opos));
    rows.push_back(r);
  }
  for (size_t i = 0; i < e.inputs.size(); ++i) {
    Row r = rep;
    r.in[first_slot + i] = partial;
    r.out[0] = partial;
    rows.push_back(r);
  }
  return rows;
}

StrategyFn einsum(const std::string& spec) {
  Einsum e = parseEinsum(spec);
  return [e](const OpCall& call, int64_t m) {
    return einsumRows(e, call.specs.size(), 0, rules::linear_partial(call, m));
  };
}

// addmm(bias, a, b) = beta*bias + alpha*(a@b): the bias follows the output,
// sharding its aligned dim, and becomes Partial where the output is (R -> P
// keeps it on one rank so that the sum adds it once).
StrategyFn withBias(const std::string& spec) {
  Einsum e = parseEinsum(spec);
  return [e](const OpCall& call, int64_t m) {
    auto rows = einsumRows(e, call.specs.size(), 1, rules::linear_partial(call, m));
    const auto& bias = call.spec(0).shape;
    const auto& out = call.out_shapes[0];
    const int64_t off = static_cast<int64_t>(out.size() - bias.size());
    for (auto& r : rows) {
      const Placement& o = r.out[0];
      if (o.is_shard()) {
        const int64_t bd = o.dim - off;
        r.in[0] = bd >= 0 && bias[bd] == out[o.dim] ? Shard(bd) : Replicate();
      } else {
        r.in[0] = o;
      }
    }
    return rows;
  };
}

// An n-D operand times a matrix, "<batch>k,kn-><batch>n" (matmul) or, with
// the matrix transposed, "<batch>k,nk-><batch>n" (linear, whose bias, the
// third slot, follows the output's last dim as addmm's does). Reached without
// autograd only (NOTE: [Fused ops without autograd]), and only for the shapes
// of NOTE: [Which products fuse] (fuses_as_product, dtensor/fused_ops.h):
// x at least 1-D (2-D for matmul) by a 2-D matrix.
StrategyFn byMatrix(bool transposed) {
  return [transposed](const OpCall& call, int64_t m) {
    const int64_t n = call.spec(0).ndim();
    std::string batch;
    for (int64_t i = 0; i + 1 < n; ++i) batch += static_cast<char>('A' + i);
    const Einsum e{{batch + "k", transposed ? "nk" : "kn"}, batch + "n"};
    auto rows = einsumRows(e, call.specs.size(), 0, rules::linear_partial(call, m));
    if (call.specs.size() < 3) return rows;
    const auto& bias = call.spec(2).shape;
    const bool aligned = bias.size() == 1 && bias[0] == call.spec(1).shape[0];
    for (auto& r : rows) {
      const Placement& o = r.out[0];
      r.in[2] = !o.is_shard() ? o : o.dim == n - 1 && aligned ? Shard(0) : Replicate();
    }
    return rows;
  };
}

// dot has no Meta kernel in libtorch 1.13: a 0-dim output.
OutputMeta scalarShape(const OpCall& call) { return OutputMeta{{{}}, {call.spec(0).dtype}}; }

}  // namespace

void registerMatrixRules(RuleRegistry& r) {
  r.add("aten::mm", einsum("mk,kn->mn"));
  r.add("aten::bmm", einsum("bmk,bkn->bmn"));
  r.add("aten::dot", einsum("k,k->"), scalarShape);
  r.add("aten::mv", einsum("mk,k->m"));
  r.add("aten::addmm", withBias("mk,kn->mn"));
  r.add("aten::baddbmm", withBias("bmk,bkn->bmn"));
  // The local op by detail::linear_local / matmul_local: NOTE: [One-row linear].
  r.add("aten::linear", byMatrix(/*transposed=*/true), /*shape=*/nullptr, &detail::linear_local);
  r.add("aten::matmul", byMatrix(/*transposed=*/false), /*shape=*/nullptr, &detail::matmul_local);
}

}  // namespace dtp
