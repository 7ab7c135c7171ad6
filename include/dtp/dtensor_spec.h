// DTensorSpec: what a DTensor is globally (mesh, placements, shape, dtype), and
// which part of it each rank holds.
#pragma once

#include "dtp/device_mesh.h"
#include "dtp/placement.h"

#include <c10/core/ScalarType.h>

#include <memory>

namespace dtp {

// Per-tensor data behind what its placements say (MaskPartial's mask,
// sums known without communication): src/dtensor/spec_facts.h.
struct SpecFacts;

struct DTensorSpec {
  DeviceMesh mesh;
  Placements placements;
  std::vector<int64_t> shape;  // global
  c10::ScalarType dtype = c10::ScalarType::Float;
  // This rank's shard shape, filled by make_spec (cached: read on every op).
  std::vector<int64_t> local_sizes;
  // What this tensor's maker knew of its shard (NOTE: [Facts in specs],
  // src/dtensor/spec_facts.h): per tensor, so never part of ==, hash() or
  // str(); null for almost every tensor.
  std::shared_ptr<const SpecFacts> facts;

  int64_t ndim() const { return static_cast<int64_t>(shape.size()); }
  int64_t numel() const;
  bool has_partial() const;  // Partial or MaskPartial on some mesh dim
  bool is_replicated() const;  // R on every mesh dim
  // Shape and offset of the shard at mesh `coordinate` (this rank's by default).
  std::vector<int64_t> local_shape(const std::vector<int64_t>& coordinate) const;
  std::vector<int64_t> local_shape() const { return local_shape(mesh.get_coordinate()); }
  std::vector<int64_t> local_offset(const std::vector<int64_t>& coordinate) const;
  std::vector<int64_t> local_offset() const { return local_offset(mesh.get_coordinate()); }
  // e.g. "f32[8,16](S(0)R)"
  std::string str() const;
  size_t hash() const;
  bool operator==(const DTensorSpec& o) const {
    return shape == o.shape && dtype == o.dtype && placements == o.placements && mesh == o.mesh;
  }
};

// A spec with local_sizes filled in; checks placements against mesh and shape.
std::shared_ptr<const DTensorSpec> make_spec(DeviceMesh mesh, Placements placements,
                                             std::vector<int64_t> shape, c10::ScalarType dtype);

// torch.chunk along one dimension: the size and start of chunk `idx` of `n`
// elements split in `parts`. f32[5] on 4 ranks -> sizes 2,2,1,0.
// See NOTE: [Uneven shards].
int64_t chunk_size(int64_t n, int64_t parts, int64_t idx);
int64_t chunk_start(int64_t n, int64_t parts, int64_t idx);
std::vector<int64_t> chunk_sizes(int64_t n, int64_t parts);

// Short dtype names used in spec strings: f32, f64, bf16, i64, b8...
std::string short_dtype_name(c10::ScalarType t);

}  // namespace dtp
