// DeviceMesh: an N-D grid of ranks with one process group per mesh dimension.
//
//   auto mesh = dtp::init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
//   mesh["tp"].get_group(0)            // the ranks that share my dp coordinate
//   std::cout << mesh;                 // DeviceMesh((dp=2, tp=2), cpu)
#pragma once

#include "dtp/process_group.h"

#include <c10/core/Device.h>

#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dtp {

class DeviceMesh {
 public:
  struct Impl;
  DeviceMesh() = default;

  bool valid() const { return impl_ != nullptr; }
  const std::string& device_type() const;
  // This rank's device: cpu, or cuda:LOCAL_RANK (NOTE: [The rank's device]).
  c10::Device device() const;
  int64_t ndim() const;
  std::vector<int64_t> shape() const;
  int64_t size(int64_t dim) const;
  int64_t size() const;  // number of ranks in the mesh
  const std::vector<std::string>& mesh_dim_names() const;
  // The mesh as a tensor of global ranks, shaped like the mesh.
  at::Tensor mesh() const;

  // Slicing by name: a contiguous run of dimensions, in mesh order.
  DeviceMesh operator[](const std::string& name) const;
  DeviceMesh operator[](const std::vector<std::string>& names) const;
  // So that mesh[{"dp", "tp"}] picks the list, not std::string's iterator-pair constructor.
  DeviceMesh operator[](std::initializer_list<std::string> names) const {
    return (*this)[std::vector<std::string>(names)];
  }

  // PyTorch's DeviceMesh._flatten: this (sub)mesh's dimensions as one, named
  // `name` (default: their names joined by "_"), over its ranks in row-major
  // order, with ONE process group over them; the whole mesh learns the name:
  //   auto dp = mesh[{"dp_replicate", "dp_shard"}].flatten("dp");  // (dp=4)
  //   mesh["dp"] == dp; mesh[{"dp", "tp"}]                         // (dp=4, tp=2)
  // Collective the first time a name is given: every rank of the whole mesh
  // (the one init_device_mesh made) calls it, in the same order relative to
  // other group creations; a rank that flattens other dimensions, or skips
  // the call, makes every rank fail naming DeviceMesh::flatten. Again with the
  // same name and dimensions: the same group, no collective. A name of a
  // mesh dimension, or one given to other dimensions, is an error; a 1-D
  // mesh under its own name is itself. See NOTE: [Flattened dimensions] in
  // src/mesh/flatten.cpp.
  DeviceMesh flatten(const std::string& name = "") const;

  // The whole mesh this one was sliced or flattened from (init_device_mesh's;
  // itself when it is that one), as PyTorch's DeviceMesh._get_root_mesh:
  // mesh["tp"].get_root_mesh().id() == mesh.id().
  DeviceMesh get_root_mesh() const;

  int get_rank() const;  // global rank of this process
  int64_t get_local_rank(int64_t dim = 0) const;
  int64_t get_local_rank(const std::string& name) const;
  std::vector<int64_t> get_coordinate() const;
  ProcessGroup get_group(int64_t dim = 0) const;
  ProcessGroup get_group(const std::string& name) const;
  int64_t dim_index(const std::string& name) const;

  std::string str() const;
  // Identity of this mesh object (copies share it); used as a cache key.
  const void* id() const { return impl_.get(); }
  bool operator==(const DeviceMesh& other) const;
  bool operator!=(const DeviceMesh& other) const { return !(*this == other); }

  explicit DeviceMesh(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

 private:
  friend DeviceMesh select_mesh_dims(const DeviceMesh& mesh, const std::vector<int64_t>& dims);
  friend ProcessGroup flattened_group(const DeviceMesh& mesh, const std::vector<int64_t>& dims, const char* api);
  // The mesh's state; a clear error on an invalid (default) handle.
  const Impl& impl() const;
  std::shared_ptr<const Impl> impl_;
};

std::ostream& operator<<(std::ostream& os, const DeviceMesh& mesh);

// Builds a mesh over the default process group of this thread (or `world`),
// creating every sub-group once. Collective: all ranks call it in the same
// order. The product of `shape` must equal the world size.
DeviceMesh init_device_mesh(const std::string& device_type, const std::vector<int64_t>& shape,
                            const std::vector<std::string>& mesh_dim_names = {},
                            std::optional<ProcessGroup> world = std::nullopt);

}  // namespace dtp
