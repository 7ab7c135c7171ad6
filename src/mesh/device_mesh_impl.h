// DeviceMesh's state, shared by the files of src/mesh (device_mesh.cpp: making
// and slicing meshes; flatten.cpp: groups over several dimensions).
#pragma once

#include "dtp/device_mesh.h"

#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace dtp {

struct DeviceMesh::Impl {
  std::string device_type;
  c10::Device device{c10::kCPU};  // NOTE: [The rank's device]
  std::vector<int64_t> shape;
  std::vector<int> ranks;  // global ranks, row-major over `shape`
  std::vector<std::string> names;
  std::vector<int64_t> coordinate;  // of this rank
  std::vector<ProcessGroup> groups;  // one per mesh dimension
  int rank = 0;  // global rank of this process
  ProcessGroup world;  // what init_device_mesh made it from (root meshes only)
  std::shared_ptr<const DeviceMesh::Impl> root;  // a slice's whole mesh (null: this is one)
  // A slice's dimensions in the whole mesh: one run per dimension, of one
  // whole-mesh dimension, or of several for a flattened one (row-major).
  std::vector<std::vector<int64_t>> root_dims;
  mutable std::mutex flat_mu;
  mutable std::map<std::vector<int64_t>, ProcessGroup> flat;  // flattened_group's, by dims
  // Root meshes only: the names given by DeviceMesh::flatten, and their
  // dimensions. See NOTE: [Flattened dimensions].
  mutable std::map<std::string, std::vector<int64_t>> flat_names;
};

namespace detail {

inline std::vector<int64_t> strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d) s[d] = s[d + 1] * shape[d + 1];
  return s;
}

}  // namespace detail
}  // namespace dtp
