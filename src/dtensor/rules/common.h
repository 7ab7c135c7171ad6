// Helpers shared by the rule families.
#pragma once

#include "dtensor/rule_registry.h"

namespace dtp::rules {

// Rows with every input and output replicated.
inline Row replicate_row(const OpCall& call) {
  return Row{Placements(call.specs.size(), Replicate()),
             Placements(call.num_outputs, Replicate())};
}

// The partial a linear op keeps on mesh dim m: P(avg) if an input is P(avg)
// there, else P(sum).
inline Placement linear_partial(const OpCall& call, int64_t m) {
  for (const auto* s : call.specs)
    if (s->placements[m].is_partial() && s->placements[m].op == ReduceOp::Avg) return Partial(ReduceOp::Avg);
  return Partial(ReduceOp::Sum);
}

// Into how many pieces tensor dim `d` of `slot` may be cut if mesh dim `m`
// shards it. A 2-D mesh can shard one dim twice (f64[2,3,4](S(1)S(1)) on
// (2,2): rows 2,1 then 1,1 and 1,0), and each mesh dim picks its row alone,
// so evenness over m's size is not enough. If m shards `d` now, the mesh
// dims that shard it now; else any mesh dim may move to it as m does, so
// all of them.
inline int64_t shardCount(const OpCall& call, size_t slot, int64_t d, int64_t m) {
  const auto& pl = call.spec(slot).placements;
  int64_t k = 1;
  for (size_t i = 0; i < pl.size(); ++i) {
    const bool mi = static_cast<int64_t>(i) == m;
    if (mi || pl[i].is_shard(d) || !pl[m].is_shard(d)) k *= call.mesh().size(static_cast<int64_t>(i));
  }
  return k;
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
inline OutputMeta self_shape(const OpCall& call) { return OutputMeta{{call.spec(0).shape}, {call.spec(0).dtype}}; }

// Rows of an elementwise op with broadcasting over all slots: shard any output
// dim (inputs shard their aligned dim, or stay R where they broadcast), all
// replicated, and the Partial rows that `lin` allows. `written` slots (in-place
// targets) keep their placement through the cost model.
std::vector<Row> pointwise_rows(const OpCall& call, int64_t mesh_dim, Linearity lin);

// Output dtypes from running the op on one-element CPU stand-ins of the
// inputs, for ops without meta kernels. Shapes are left to the caller.
std::vector<c10::ScalarType> dtypesFromStandIns(const OpCall& call);

}  // namespace dtp::rules
