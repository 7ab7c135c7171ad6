// Helpers shared by the rule families.
#pragma once

#include "dtensor/rule_registry.h"

namespace dtp::rules {

// Rows with every input and output replicated.
inline Row replicateRow(const OpCall& call) {
  return Row{Placements(call.specs.size(), Replicate()),
             Placements(call.num_outputs, Replicate())};
}

// The partial a linear op keeps on mesh dim m: P(avg) if an input is P(avg)
// there, else P(sum).
inline Placement linearPartial(const OpCall& call, int64_t m) {
  for (const auto* s : call.specs)
    if (s->placements[m].is_partial() && s->placements[m].op == ReduceOp::Avg) return Partial(ReduceOp::Avg);
  return Partial(ReduceOp::Sum);
}

// How a pointwise op treats Partial inputs.
enum class Linearity {
  None,         // exp, relu...: Partial inputs must be reduced first
  Linear,       // add, sub, neg, clone: all-Partial in -> Partial out
  Multilinear,  // mul: one Partial input, the rest Replicate -> Partial out
  FirstArg,     // div: Partial numerator, Replicate denominator -> Partial out
};

// The output is shaped and typed like the first tensor input (for ops
// without meta kernels in some libtorch version).
inline OutputMeta selfShape(const OpCall& call) { return OutputMeta{{call.spec(0).shape}, {call.spec(0).dtype}}; }

// Rows of an elementwise op with broadcasting over all slots: shard any output
// dim (inputs shard their aligned dim, or stay R where they broadcast), all
// replicated, and the Partial rows that `lin` allows. `written` slots (in-place
// targets) keep their placement through the cost model.
std::vector<Row> pointwiseRows(const OpCall& call, int64_t mesh_dim, Linearity lin);

// Output dtypes from running the op on one-element CPU stand-ins of the
// inputs, for ops without meta kernels. Shapes are left to the caller.
std::vector<c10::ScalarType> dtypesFromStandIns(const OpCall& call);

}  // namespace dtp::rules
