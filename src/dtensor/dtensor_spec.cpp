#include "dtp/dtensor_spec.h"

#include <c10/util/hash.h>

#include <sstream>

namespace dtp {

std::string Placement::str() const {
  switch (kind) {
    case Kind::Replicate: return "R";
    case Kind::Shard: return "S(" + std::to_string(dim) + ")";
    case Kind::Partial: return "P(" + to_string(op) + ")";
    // NOTE: [MaskPartial]: MaskP(offset dim, offset size).
    case Kind::MaskPartial: return "MaskP(" + std::to_string(dim) + "," + std::to_string(size) + ")";
  }
  return "?";
}

std::string to_string(const Placements& placements) {
  std::string s;
  for (const auto& p : placements) s += p.str();
  return s;
}

int64_t chunk_size(int64_t n, int64_t parts, int64_t idx) {
  const int64_t per = (n + parts - 1) / parts;
  return std::max<int64_t>(0, std::min(per, n - idx * per));
}

int64_t chunk_start(int64_t n, int64_t parts, int64_t idx) {
  const int64_t per = (n + parts - 1) / parts;
  return std::min(n, idx * per);
}

std::vector<int64_t> chunk_sizes(int64_t n, int64_t parts) {
  std::vector<int64_t> s;
  for (int64_t i = 0; i < parts; ++i) s.push_back(chunk_size(n, parts, i));
  return s;
}

std::shared_ptr<const DTensorSpec> make_spec(DeviceMesh mesh, Placements placements,
                                             std::vector<int64_t> shape, c10::ScalarType dtype) {
  TORCH_CHECK(static_cast<int64_t>(placements.size()) == mesh.ndim(), "DTensor: got ",
              placements.size(), " placements (", to_string(placements), ") for ", mesh.str(),
              ". Give one placement per mesh dimension.");
  for (auto& p : placements) {
    if (!p.is_shard()) continue;
    const int64_t nd = static_cast<int64_t>(shape.size());
    TORCH_CHECK(p.dim >= -nd && p.dim < nd, "DTensor: ", p.str(), " is out of range for a ",
                nd, "-D tensor. Shard a dimension in [", -nd, ", ", nd, ").");
    if (p.dim < 0) p.dim += nd;
  }
  auto spec = std::make_shared<DTensorSpec>();
  spec->mesh = std::move(mesh);
  spec->placements = std::move(placements);
  spec->shape = std::move(shape);
  spec->dtype = dtype;
  spec->local_sizes = spec->local_shape(spec->mesh.get_coordinate());
  return spec;
}

int64_t DTensorSpec::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

bool DTensorSpec::has_partial() const {
  for (const auto& p : placements)
    if (p.is_partial() || p.is_mask_partial()) return true;
  return false;
}

bool DTensorSpec::is_replicated() const {
  for (const auto& p : placements)
    if (!p.is_replicate()) return false;
  return true;
}

// Mesh dimensions shard in order: on S(0)S(0) over a (2,2) mesh, mesh dim 0
// chunks rows first and mesh dim 1 chunks each half again (PyTorch's order).
std::vector<int64_t> DTensorSpec::local_shape(const std::vector<int64_t>& coordinate) const {
  std::vector<int64_t> s = shape;
  for (size_t m = 0; m < placements.size(); ++m) {
    if (placements[m].is_shard()) {
      const int64_t d = placements[m].dim;
      s[d] = chunk_size(s[d], mesh.size(m), coordinate[m]);
    }
  }
  return s;
}

std::vector<int64_t> DTensorSpec::local_offset(const std::vector<int64_t>& coordinate) const {
  std::vector<int64_t> s = shape, off(shape.size(), 0);
  for (size_t m = 0; m < placements.size(); ++m) {
    if (placements[m].is_shard()) {
      const int64_t d = placements[m].dim;
      off[d] += chunk_start(s[d], mesh.size(m), coordinate[m]);
      s[d] = chunk_size(s[d], mesh.size(m), coordinate[m]);
    }
  }
  return off;
}

std::string short_dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return "f32";
    case c10::kDouble: return "f64";
    case c10::kHalf: return "f16";
    case c10::kBFloat16: return "bf16";
    case c10::kLong: return "i64";
    case c10::kInt: return "i32";
    case c10::kShort: return "i16";
    case c10::kChar: return "i8";
    case c10::kByte: return "u8";
    case c10::kBool: return "b8";
    default: return c10::toString(t);
  }
}

std::string DTensorSpec::str() const {
  std::ostringstream os;
  os << short_dtype_name(dtype) << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? "," : "") << shape[i];
  os << "](" << to_string(placements) << ")";
  return os.str();
}

size_t DTensorSpec::hash() const {
  size_t h = c10::get_hash(static_cast<int>(dtype));
  for (int64_t s : shape) h = c10::hash_combine(h, std::hash<int64_t>()(s));
  for (const auto& p : placements) h = c10::hash_combine(h, p.hash());
  return h;
}

}  // namespace dtp
