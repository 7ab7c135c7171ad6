// Placements of a DTensor on one mesh dimension: Shard(dim), Replicate(),
// Partial(op), MaskPartial(offset_size). Printed compactly as S(0), R,
// P(sum), MaskP(0,10).
#pragma once

#include "dtp/process_group.h"

#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

namespace dtp {

// NOTE: [MaskPartial]
// A Partial(sum) that knows why it is partial, as PyTorch's _MaskPartial:
// a lookup into a table whose dim `dim` (of `size` entries) is sharded on
// this mesh dim (the vocabulary-parallel embedding: weight [V, D] S(0),
// indices R -> output MaskP(0,V)). Each position of the value belongs to the
// one rank whose rows hold its id; that rank's shard holds the value there,
// and the others' hold anything. The tensor's spec carries the mask (which
// positions are other ranks', SpecFacts::mask), filled by the op that made
// it; reducing it (to Replicate, Shard or Partial) first applies the mask
// (zeros elsewhere), then runs the Partial's collective; the mask goes with
// the last spec that holds it. A gradient of a MaskPartial tensor is one
// too (the backward of its redistribution), which tells the embedding's
// backward to compute only this rank's rows: O(V / tp), not O(V).
// Not Partial for rules: is_partial() is false, so a rule never takes it
// for a plain sum; an op that accepts Partial gets it through a local
// MaskP -> P step. Two are equal when dim and size are (PyTorch compares
// offset_shape and offset_dim; only the entry at offset_dim decides a mask).
struct Placement {
  enum class Kind : uint8_t { Replicate, Shard, Partial, MaskPartial };
  Kind kind = Kind::Replicate;
  int64_t dim = 0;              // Shard: the tensor dim; MaskPartial: the table's sharded dim
  ReduceOp op = ReduceOp::Sum;  // Partial, MaskPartial (always Sum)
  int64_t size = 0;             // MaskPartial only: the table's size along `dim`

  bool is_replicate() const { return kind == Kind::Replicate; }
  bool is_shard() const { return kind == Kind::Shard; }
  bool is_shard(int64_t d) const { return kind == Kind::Shard && dim == d; }
  bool is_partial() const { return kind == Kind::Partial; }
  bool is_mask_partial() const { return kind == Kind::MaskPartial; }
  std::string str() const;

  bool operator==(const Placement& o) const {
    if (kind != o.kind) return false;
    switch (kind) {
      case Kind::Shard: return dim == o.dim;
      case Kind::Partial: return op == o.op;
      case Kind::MaskPartial: return dim == o.dim && size == o.size;
      default: return true;
    }
  }
  bool operator!=(const Placement& o) const { return !(*this == o); }
  size_t hash() const {
    return static_cast<size_t>(kind) * 1000003u + (is_shard() || is_mask_partial() ? dim : 0) * 31u +
           (is_partial() ? static_cast<size_t>(op) : 0) + (is_mask_partial() ? static_cast<size_t>(size) * 7919u : 0);
  }
};

inline Placement Shard(int64_t dim) { return {Placement::Kind::Shard, dim, ReduceOp::Sum, 0}; }
inline Placement Replicate() { return {Placement::Kind::Replicate, 0, ReduceOp::Sum, 0}; }
inline Placement Partial(ReduceOp op = ReduceOp::Sum) {
  return {Placement::Kind::Partial, 0, op, 0};
}
// The output of a lookup into a table of `offset_size` entries along its dim
// `offset_dim`, sharded on this mesh dim (NOTE: [MaskPartial]). Made by ops
// (the embedding); redistributing into it is NYI.
inline Placement MaskPartial(int64_t offset_size, int64_t offset_dim = 0) {
  return {Placement::Kind::MaskPartial, offset_dim, ReduceOp::Sum, offset_size};
}

// One placement per mesh dimension.
using Placements = std::vector<Placement>;
std::string to_string(const Placements& placements);  // e.g. "S(0)R"

inline std::ostream& operator<<(std::ostream& os, const Placement& p) { return os << p.str(); }

}  // namespace dtp
