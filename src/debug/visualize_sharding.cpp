#include "dtp/visualize_sharding.h"

#include "dtp/dtensor.h"

#include <ATen/ATen.h>

#include <map>
#include <sstream>

namespace dtp {

std::string visualize_sharding(const at::Tensor& t) {
  TORCH_CHECK(is_dtensor(t), "visualize_sharding: the tensor is not a DTensor (", t.sizes(),
              "). Pass the result of distribute_tensor/from_local, or a DTensor parameter.");
  const DTensorSpec& spec = dtensor_spec(t);
  const DeviceMesh& mesh = spec.mesh;
  const std::vector<int64_t> shape = mesh.shape();
  std::vector<std::string> names = mesh.mesh_dim_names();
  for (size_t m = names.size(); m < shape.size(); ++m) names.push_back("mesh dim " + std::to_string(m));
  const at::Tensor ranks = mesh.mesh().flatten().contiguous();

  // Blocks in order of their offsets, each with the ranks (and coordinates) holding it.
  std::map<std::pair<std::vector<int64_t>, std::vector<int64_t>>, std::vector<std::string>> blocks;
  std::vector<int64_t> coord(shape.size(), 0);
  for (int64_t i = 0; i < ranks.numel(); ++i) {
    int64_t rest = i;
    for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
      coord[d] = rest % shape[d];
      rest /= shape[d];
    }
    std::ostringstream who;
    who << ranks[i].item<int64_t>() << " (";
    for (size_t d = 0; d < coord.size(); ++d) who << (d ? ", " : "") << coord[d];
    who << ")";
    blocks[{spec.local_offset(coord), spec.local_shape(coord)}].push_back(who.str());
  }

  std::ostringstream os;
  os << short_dtype_name(spec.dtype) << "[";
  for (size_t d = 0; d < spec.shape.size(); ++d) os << (d ? "," : "") << spec.shape[d];
  os << "] (" << to_string(spec.placements) << ") on " << mesh.str() << "\n| block | ranks (";
  for (size_t d = 0; d < names.size(); ++d) os << (d ? ", " : "") << names[d];
  os << ") |\n|---|---|\n";
  for (const auto& [block, holders] : blocks) {
    os << "| [";
    for (size_t d = 0; d < block.first.size(); ++d)
      os << (d ? ", " : "") << block.first[d] << ":" << block.first[d] + block.second[d];
    os << "] | ";
    for (size_t k = 0; k < holders.size(); ++k) os << (k ? ", " : "") << holders[k];
    os << " |\n";
  }
  for (size_t m = 0; m < spec.placements.size(); ++m) {
    const Placement& p = spec.placements[m];
    os << names[m] << ": " << p.str();
    if (p.is_shard()) os << " splits dim " << p.dim << " in " << shape[m];
    else if (p.is_partial())
      os << ", pending: the ranks of a row differing only in " << names[m] << " hold parts whose "
         << to_string(p.op) << " is the block";
    else os << ", the ranks of a row differing only in " << names[m] << " hold equal copies";
    os << "\n";
  }
  return os.str();
}

}  // namespace dtp
