#include "mesh/flatten.h"

#include "comm/agree.h"
#include "mesh/device_mesh_impl.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <functional>
#include <numeric>

namespace dtp {

// NOTE: [Flattened dimensions]
// mesh[{"dp_replicate", "dp_shard"}].flatten("dp") on (dp_replicate=2,
// dp_shard=2, tp=2) is the 1-D mesh (dp=4) over the ranks that share this
// rank's tp coordinate, in row-major order of (dp_replicate, dp_shard): rank 5
// (coordinate 1,0,1) gets ranks 1,3,5,7 and local rank 2. Its group is ONE
// process group over those ranks, made once per whole mesh and dimensions
// (flattened_group, which HSDP shares). As PyTorch's _flatten, the name is
// registered on the whole mesh (the root): afterwards root["dp"] is that mesh
// and root[{"dp", "tp"}] the (dp=4, tp=2) one, when the names cover adjacent
// dimensions in mesh order, as for any slice. A slice does not know the names
// (in PyTorch neither).
//   - The same dimensions under the same name again: a mesh on the same
//     group, with no collective.
//   - The same name for other dimensions, or the name of one of the whole
//     mesh's own dimensions: an error naming both.
//   - A 1-D mesh under its own name (or none) is itself; under a new name it
//     is registered and keeps its dimension's group (PyTorch makes a second
//     group over the same ranks).
// Registering a name is collective over the whole mesh's ranks: they first
// agree on (name, dimensions) (agree_on_value, two all_gathers over the
// mesh's world), so a rank that flattens other dimensions, or none, makes
// every rank fail naming DeviceMesh::flatten instead of stalling in the
// group creation that follows.

namespace {

std::string dimNames(const DeviceMesh::Impl& root, const std::vector<int64_t>& dims) {
  std::vector<std::string> n;
  for (int64_t d : dims) n.push_back(root.names.empty() ? std::to_string(d) : root.names[d]);
  return "(" + c10::Join(", ", n) + ")";
}

// The slice of the whole mesh with one dimension per run of its dimensions: a
// run of one keeps that dimension's group, a longer one is flattened.
DeviceMesh meshOverRuns(const std::shared_ptr<const DeviceMesh::Impl>& root_ptr,
                        const std::vector<std::vector<int64_t>>& runs, const std::vector<std::string>& names,
                        const char* api) {
  const DeviceMesh::Impl& root = *root_ptr;
  auto impl = std::make_shared<DeviceMesh::Impl>();
  impl->device_type = root.device_type;
  impl->device = root.device;
  impl->rank = root.rank;
  impl->names = names;
  impl->root = root_ptr;
  impl->root_dims = runs;
  std::vector<int64_t> all, all_shape;
  for (const auto& run : runs) {
    int64_t size = 1, coord = 0;
    for (int64_t d : run) {
      size *= root.shape[d];
      coord = coord * root.shape[d] + root.coordinate[d];
      all.push_back(d);
      all_shape.push_back(root.shape[d]);
    }
    impl->shape.push_back(size);
    impl->coordinate.push_back(coord);
    impl->groups.push_back(run.size() == 1 ? root.groups[run[0]] : flattened_group(DeviceMesh(root_ptr), run, api));
  }
  // This rank's line: the ranks that share its coordinate on every other dimension.
  const auto st = detail::strides(root.shape);
  int64_t base = 0;
  for (int64_t d = 0; d < static_cast<int64_t>(root.shape.size()); ++d)
    if (std::find(all.begin(), all.end(), d) == all.end()) base += root.coordinate[d] * st[d];
  const auto all_st = detail::strides(all_shape);
  const int64_t n = std::accumulate(all_shape.begin(), all_shape.end(), int64_t{1}, std::multiplies<>());
  for (int64_t i = 0; i < n; ++i) {
    int64_t flat = base;
    for (size_t k = 0; k < all.size(); ++k) flat += i / all_st[k] % all_shape[k] * st[all[k]];
    impl->ranks.push_back(root.ranks[flat]);
  }
  return DeviceMesh(std::move(impl));
}

}  // namespace

DeviceMesh DeviceMesh::flatten(const std::string& name_in) const {
  constexpr const char* api = "DeviceMesh::flatten";
  const Impl& self = impl();
  TORCH_CHECK(!self.names.empty(), api, ": dimension names for ", str(),
              ": got none, expected one per dimension (the flattened name joins them). Give init_device_mesh "
              "mesh_dim_names.");
  const std::string name = name_in.empty() ? c10::Join("_", self.names) : name_in;
  if (ndim() == 1 && name == self.names[0]) return *this;
  const std::shared_ptr<const Impl> root = self.root ? self.root : impl_;
  TORCH_CHECK(root->world.valid(), api, ": process groups for ", str(),
              ": got a mesh without them (for communication-free rule tests), expected one from init_device_mesh. "
              "Build the mesh with init_device_mesh.");
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < ndim(); ++d) {
    if (self.root) {
      dims.insert(dims.end(), self.root_dims[d].begin(), self.root_dims[d].end());
    } else {
      dims.push_back(d);
    }
  }
  const std::string what = "name '" + name + "' for " + dimNames(*root, dims) + " of " + DeviceMesh(root).str();
  TORCH_CHECK(std::find(root->names.begin(), root->names.end(), name) == root->names.end(), api, ": ", what,
              ": got the name of one of its own dimensions, expected a new name. Pass another name, as "
              "flatten(\"", c10::Join("_", self.names), "_flat\").");
  bool known = false;
  {
    std::lock_guard<std::mutex> lock(root->flat_mu);
    auto it = root->flat_names.find(name);
    if (it != root->flat_names.end()) {
      TORCH_CHECK(it->second == dims, api, ": ", what, ": got a name already given to the flattened ",
                  dimNames(*root, it->second), ", expected a new name. Pass another name, or flatten ",
                  dimNames(*root, it->second), " to get '", name, "' again.");
      known = true;
    }
  }
  // A new name: every rank registers it, in the same order. See NOTE: [Flattened dimensions].
  if (!known) agree_on_value(root->world, api, "names and dimensions", name + " = " + dimNames(*root, dims));
  DeviceMesh flat = meshOverRuns(root, {dims}, {name}, api);
  if (!known) {
    std::lock_guard<std::mutex> lock(root->flat_mu);
    root->flat_names.emplace(name, dims);
  }
  return flat;
}

DeviceMesh DeviceMesh::get_root_mesh() const {
  const Impl& self = impl();
  return self.root ? DeviceMesh(self.root) : *this;
}

std::optional<DeviceMesh> slice_with_flattened(const std::shared_ptr<const DeviceMesh::Impl>& root_ptr,
                                               const std::vector<std::string>& names) {
  const DeviceMesh::Impl& root = *root_ptr;
  std::vector<std::vector<int64_t>> runs;
  std::vector<std::string> flat_names;
  bool any = false;
  {
    std::lock_guard<std::mutex> lock(root.flat_mu);
    for (const auto& [n, dims] : root.flat_names) flat_names.push_back(n);
    for (const auto& n : names) {
      auto own = std::find(root.names.begin(), root.names.end(), n);
      auto it = root.flat_names.find(n);
      if (own != root.names.end()) {
        runs.push_back({own - root.names.begin()});
      } else if (it != root.flat_names.end()) {
        runs.push_back(it->second);
        any = true;
      } else {
        runs.emplace_back();  // unknown: reported below
      }
    }
  }
  if (!any) return std::nullopt;  // a plain slice; DeviceMesh::operator[] reports unknown names
  const std::string mesh = DeviceMesh(root_ptr).str();
  for (size_t i = 0; i < names.size(); ++i) {
    TORCH_CHECK(!runs[i].empty(), "DeviceMesh: dimension '", names[i], "' of ", mesh, ": got no such name, expected ",
                "one of (", c10::Join(", ", root.names), ") or a flattened one (", c10::Join(", ", flat_names),
                "). Use one of those names, or flatten the dimensions first.");
  }
  std::vector<int64_t> all;
  for (const auto& run : runs) all.insert(all.end(), run.begin(), run.end());
  for (size_t k = 1; k < all.size(); ++k) {
    TORCH_CHECK(all[k] == all[k - 1] + 1, "DeviceMesh: slicing ", mesh, " by ", c10::Join(",", names),
                ": got dimensions ", dimNames(root, all), ", expected adjacent dimensions in mesh order, each once. "
                "For example, with dp flattened from (dp_replicate, dp_shard) of (dp_replicate, dp_shard, tp), ask "
                "for {dp, tp}, not {tp, dp} or {dp, dp_shard}.");
  }
  return meshOverRuns(root_ptr, runs, names, "DeviceMesh::operator[]");
}

ProcessGroup flattened_group(const DeviceMesh& mesh, const std::vector<int64_t>& dims, const char* api) {
  if (mesh.impl().root) {  // a slice: the group is made on its whole mesh, by every rank of it
    std::vector<int64_t> in_root;
    for (int64_t d : dims) {
      const auto& run = mesh.impl().root_dims.at(d);
      in_root.insert(in_root.end(), run.begin(), run.end());
    }
    return flattened_group(DeviceMesh(mesh.impl().root), in_root, api);
  }
  const DeviceMesh::Impl& self = mesh.impl();
  TORCH_CHECK(self.world.valid(), api, ": ", mesh.str(), " was not made by init_device_mesh; one group over several "
              "of its dimensions is made on the whole mesh, by every rank. Build the mesh with init_device_mesh.");
  std::lock_guard<std::mutex> lock(self.flat_mu);
  auto it = self.flat.find(dims);
  if (it != self.flat.end()) return it->second;
  const auto st = detail::strides(self.shape);
  std::vector<int64_t> line_shape;
  for (int64_t d : dims) line_shape.push_back(self.shape[d]);
  const auto line_st = detail::strides(line_shape);
  const int64_t per_line = std::accumulate(line_shape.begin(), line_shape.end(), int64_t{1}, std::multiplies<>());
  const int64_t n = static_cast<int64_t>(self.ranks.size());
  ProcessGroup mine;
  if (per_line == n) {
    mine = self.world;
  } else {
    for (int64_t start = 0; start < n; ++start) {  // the first rank of each line, in order
      bool first = true;
      for (int64_t d : dims) first = first && start / st[d] % self.shape[d] == 0;
      if (!first) continue;
      std::vector<int> members;
      for (int64_t i = 0; i < per_line; ++i) {
        int64_t r = start;
        for (size_t k = 0; k < dims.size(); ++k) r += i / line_st[k] % line_shape[k] * st[dims[k]];
        members.push_back(static_cast<int>(r));
      }
      ProcessGroup g = self.world.new_group(members);
      if (g.valid()) mine = g;
    }
  }
  self.flat.emplace(dims, mine);
  return mine;
}

}  // namespace dtp
