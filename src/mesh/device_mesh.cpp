#include "dtp/device_mesh.h"

#include "comm/local_device.h"
#include "mesh/device_mesh_impl.h"
#include "mesh/fake_mesh.h"
#include "mesh/flatten.h"
#include "mesh/select_dims.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <numeric>
#include <ostream>
#include <set>
#include <sstream>

namespace dtp {


namespace {

using detail::strides;

std::string shapeStr(const std::vector<int64_t>& shape, const std::vector<std::string>& names) {
  std::ostringstream os;
  os << "(";
  for (size_t d = 0; d < shape.size(); ++d) {
    os << (d ? ", " : "");
    if (!names.empty()) os << names[d] << "=";
    os << shape[d];
  }
  if (shape.size() == 1 && names.empty()) os << ",";
  os << ")";
  return os.str();
}

}  // namespace

const DeviceMesh::Impl& DeviceMesh::impl() const {
  TORCH_CHECK(impl_ != nullptr, "DeviceMesh: this handle is invalid (default-constructed). Build a mesh with "
              "init_device_mesh(\"cpu\", {world_size}).");
  return *impl_;
}

const std::string& DeviceMesh::device_type() const { return impl().device_type; }
c10::Device DeviceMesh::device() const { return impl().device; }
int64_t DeviceMesh::ndim() const { return static_cast<int64_t>(impl().shape.size()); }
std::vector<int64_t> DeviceMesh::shape() const { return impl().shape; }
int64_t DeviceMesh::size() const { return static_cast<int64_t>(impl().ranks.size()); }
const std::vector<std::string>& DeviceMesh::mesh_dim_names() const { return impl().names; }
int DeviceMesh::get_rank() const { return impl().rank; }
std::vector<int64_t> DeviceMesh::get_coordinate() const { return impl().coordinate; }

int64_t DeviceMesh::size(int64_t dim) const {
  TORCH_CHECK(dim >= 0 && dim < ndim(), "DeviceMesh: dim ", dim, " out of range for ",
              str(), ". Expected 0 <= dim < ", ndim(), ".");
  return impl().shape[dim];
}

at::Tensor DeviceMesh::mesh() const {
  std::vector<int64_t> r(impl().ranks.begin(), impl().ranks.end());
  return at::tensor(r, at::kLong).view(impl().shape);
}

int64_t DeviceMesh::dim_index(const std::string& name) const {
  auto it = std::find(impl().names.begin(), impl().names.end(), name);
  TORCH_CHECK(it != impl().names.end(), "DeviceMesh: no dimension named '", name, "' in ",
              str(), ". ",
              impl().names.empty() ? "Give init_device_mesh mesh_dim_names to slice by name."
                                   : "Use one of the mesh's dimension names.");
  return it - impl().names.begin();
}

int64_t DeviceMesh::get_local_rank(int64_t dim) const {
  size(dim);  // validates dim
  return impl().coordinate[dim];
}
int64_t DeviceMesh::get_local_rank(const std::string& name) const {
  return get_local_rank(dim_index(name));
}

ProcessGroup DeviceMesh::get_group(int64_t dim) const {
  size(dim);
  TORCH_CHECK(impl().groups[dim].valid(), "DeviceMesh: ", str(), " has no process group on dim ", dim,
              " (a mesh for communication-free rule tests). Build the mesh with init_device_mesh.");
  return impl().groups[dim];
}
ProcessGroup DeviceMesh::get_group(const std::string& name) const {
  return get_group(dim_index(name));
}

DeviceMesh DeviceMesh::operator[](const std::string& name) const {
  return (*this)[std::vector<std::string>{name}];
}

DeviceMesh DeviceMesh::operator[](const std::vector<std::string>& names) const {
  const Impl& self = impl();
  TORCH_CHECK(!names.empty(), "DeviceMesh: slicing ", str(), " needs at least one name.");
  if (!self.root) {  // only the whole mesh knows its flattened names (NOTE: [Flattened dimensions])
    if (auto sliced = slice_with_flattened(impl_, names)) return *sliced;
  }
  std::vector<int64_t> dims;
  for (const auto& n : names) dims.push_back(dim_index(n));
  for (size_t i = 1; i < dims.size(); ++i) {
    TORCH_CHECK(dims[i] == dims[i - 1] + 1, "DeviceMesh: cannot slice ", str(), " by ",
                c10::Join(",", names),
                ": the names must be adjacent dimensions in mesh order. For example, on "
                "(dp, cp, tp) ask for {dp, cp} or {cp, tp}, not {tp, dp} or {dp, tp}.");
  }
  return select_mesh_dims(*this, dims);
}

DeviceMesh select_mesh_dims(const DeviceMesh& mesh, const std::vector<int64_t>& dims) {
  const DeviceMesh::Impl& self = mesh.impl();
  auto impl = std::make_shared<DeviceMesh::Impl>();
  impl->device_type = self.device_type;
  impl->device = self.device;
  impl->rank = self.rank;
  for (int64_t d : dims) {
    TORCH_CHECK(d >= 0 && d < mesh.ndim(), "select_mesh_dims: dim ", d, " out of range for ", mesh.str());
    if (!self.names.empty()) impl->names.push_back(self.names[d]);
  }
  // The sub-mesh holds the ranks that share this rank's coordinate on every
  // dimension not kept.
  const auto st = strides(self.shape);
  int64_t base = 0;
  for (int64_t d = 0; d < mesh.ndim(); ++d) {
    bool kept = std::find(dims.begin(), dims.end(), d) != dims.end();
    if (!kept) base += self.coordinate[d] * st[d];
  }
  impl->root = self.root ? self.root : mesh.impl_;
  for (int64_t d : dims) {
    impl->shape.push_back(self.shape[d]);
    impl->coordinate.push_back(self.coordinate[d]);
    impl->groups.push_back(self.groups[d]);
    impl->root_dims.push_back(self.root ? self.root_dims[d] : std::vector<int64_t>{d});
  }
  const auto sub_st = strides(impl->shape);
  const int64_t n = std::accumulate(impl->shape.begin(), impl->shape.end(), int64_t{1},
                                    std::multiplies<>());
  for (int64_t i = 0; i < n; ++i) {
    int64_t flat = base;
    for (size_t k = 0; k < dims.size(); ++k) flat += (i / sub_st[k]) % impl->shape[k] * st[dims[k]];
    impl->ranks.push_back(self.ranks[flat]);
  }
  return DeviceMesh(std::move(impl));
}

std::string DeviceMesh::str() const {
  if (!impl_) return "DeviceMesh(invalid)";
  return "DeviceMesh(" + shapeStr(impl_->shape, impl_->names) + ", " + impl_->device_type + ")";
}

bool DeviceMesh::operator==(const DeviceMesh& other) const {
  if (impl_ == other.impl_) return true;
  if (!impl_ || !other.impl_) return false;
  return impl_->device_type == other.impl_->device_type && impl_->shape == other.impl_->shape &&
         impl_->ranks == other.impl_->ranks && impl_->groups == other.impl_->groups;
}

std::ostream& operator<<(std::ostream& os, const DeviceMesh& mesh) { return os << mesh.str(); }

DeviceMesh make_fake_device_mesh(const std::vector<int64_t>& shape, const std::vector<int64_t>& coordinate,
                                 const std::vector<std::string>& names) {
  TORCH_CHECK(!shape.empty() && coordinate.size() == shape.size() && (names.empty() || names.size() == shape.size()),
              "make_fake_device_mesh: shape ", c10::IntArrayRef(shape), ", coordinate ",
              c10::IntArrayRef(coordinate), " and ", names.size(), " names do not fit together.");
  auto impl = std::make_shared<DeviceMesh::Impl>();
  impl->device_type = "cpu";
  impl->shape = shape;
  impl->names = names;
  impl->coordinate = coordinate;
  impl->groups.resize(shape.size());
  const auto st = strides(shape);
  for (size_t d = 0; d < shape.size(); ++d) {
    TORCH_CHECK(coordinate[d] >= 0 && coordinate[d] < shape[d], "make_fake_device_mesh: coordinate ",
                c10::IntArrayRef(coordinate), " lies outside shape ", c10::IntArrayRef(shape), ".");
    impl->rank += static_cast<int>(coordinate[d] * st[d]);
  }
  const int64_t n = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
  for (int64_t r = 0; r < n; ++r) impl->ranks.push_back(static_cast<int>(r));
  return DeviceMesh(std::move(impl));
}

DeviceMesh init_device_mesh(const std::string& device_type, const std::vector<int64_t>& shape,
                            const std::vector<std::string>& names,
                            std::optional<ProcessGroup> world_in) {
  ProcessGroup world = world_in ? *world_in : default_process_group();
  const c10::Device device = detail::rank_device(device_type, world.global_ranks()[world.rank()], "init_device_mesh");
  TORCH_CHECK(!shape.empty(), "init_device_mesh: mesh shape is empty. Pass e.g. {",
              world.size(), "}.");
  for (int64_t s : shape) {
    TORCH_CHECK(s >= 1, "init_device_mesh: mesh shape ", c10::IntArrayRef(shape),
                " has a dimension < 1.");
  }
  const int64_t n = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
  TORCH_CHECK(n == world.size(), "init_device_mesh: mesh shape ", c10::IntArrayRef(shape),
              " holds ", n, " ranks, but the world has ", world.size(),
              ". Choose a shape whose product is the world size (WORLD_SIZE).");
  if (!names.empty()) {
    TORCH_CHECK(names.size() == shape.size(), "init_device_mesh: got ", names.size(),
                " mesh_dim_names for a ", shape.size(), "-D mesh shape ",
                c10::IntArrayRef(shape), ". Give one name per dimension.");
    std::set<std::string> seen;
    for (const auto& nm : names) {
      TORCH_CHECK(!nm.empty(), "init_device_mesh: empty mesh dim name.");
      TORCH_CHECK(seen.insert(nm).second, "init_device_mesh: duplicate mesh dim name '", nm,
                  "' in (", c10::Join(", ", names), "). Give each dimension its own name.");
    }
  }

  auto impl = std::make_shared<DeviceMesh::Impl>();
  impl->device_type = device_type;
  impl->device = device;
  impl->shape = shape;
  impl->names = names;
  impl->rank = world.global_ranks()[world.rank()];
  impl->world = world;
  for (int r = 0; r < world.size(); ++r) impl->ranks.push_back(world.global_ranks()[r]);
  const auto st = strides(shape);
  for (size_t d = 0; d < shape.size(); ++d) impl->coordinate.push_back(world.rank() / st[d] % shape[d]);

  // One group per line of the mesh along each dimension, created by every
  // rank in the same order (new_group is collective over the world).
  for (size_t d = 0; d < shape.size(); ++d) {
    ProcessGroup mine;
    if (shape[d] == world.size()) {
      mine = world;
    } else {
      for (int64_t start = 0; start < n; ++start) {
        if (start / st[d] % shape[d] != 0) continue;  // not the first rank of a line
        std::vector<int> members;
        for (int64_t k = 0; k < shape[d]; ++k) members.push_back(static_cast<int>(start + k * st[d]));
        ProcessGroup g = world.new_group(members);
        if (g.valid()) mine = g;
      }
    }
    impl->groups.push_back(mine);
  }
  return DeviceMesh(std::move(impl));
}

}  // namespace dtp
