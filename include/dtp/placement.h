// Placements of a DTensor on one mesh dimension: Shard(dim), Replicate(),
// Partial(op). Printed compactly as S(0), R, P(sum).
#pragma once

#include "dtp/process_group.h"

#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

namespace dtp {

struct Placement {
  enum class Kind : uint8_t { Replicate, Shard, Partial };
  Kind kind = Kind::Replicate;
  int64_t dim = 0;              // Shard only
  ReduceOp op = ReduceOp::Sum;  // Partial only

  bool is_replicate() const { return kind == Kind::Replicate; }
  bool is_shard() const { return kind == Kind::Shard; }
  bool is_shard(int64_t d) const { return kind == Kind::Shard && dim == d; }
  bool is_partial() const { return kind == Kind::Partial; }
  std::string str() const;

  bool operator==(const Placement& o) const {
    return kind == o.kind && (kind != Kind::Shard || dim == o.dim) &&
           (kind != Kind::Partial || op == o.op);
  }
  bool operator!=(const Placement& o) const { return !(*this == o); }
  size_t hash() const {
    return static_cast<size_t>(kind) * 1000003u + (is_shard() ? dim : 0) * 31u +
           (is_partial() ? static_cast<size_t>(op) : 0);
  }
};

inline Placement Shard(int64_t dim) { return {Placement::Kind::Shard, dim, ReduceOp::Sum}; }
inline Placement Replicate() { return {Placement::Kind::Replicate, 0, ReduceOp::Sum}; }
inline Placement Partial(ReduceOp op = ReduceOp::Sum) {
  return {Placement::Kind::Partial, 0, op};
}

// One placement per mesh dimension.
using Placements = std::vector<Placement>;
std::string to_string(const Placements& placements);  // e.g. "S(0)R"

inline std::ostream& operator<<(std::ostream& os, const Placement& p) { return os << p.str(); }

}  // namespace dtp
