#include "dtp/io/checkpoint_index.h"

#include "dtp/io/safetensors_file.h"
#include "io/crc32.h"

#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

namespace dtp::io {
namespace {

using Json = nlohmann::json;

at::ScalarType dtypeOf(const std::string& name, const std::string& path, const std::string& tensor) {
  for (auto t : {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kLong, at::kInt, at::kShort, at::kChar,
                 at::kByte, at::kBool}) {
    if (name == safetensors_dtype_name(t)) return t;
  }
  TORCH_CHECK(false, "load_checkpoint: '", path, "': unknown dtype '", name, "' for tensor '", tensor,
              "'. The index is corrupt; load the previous checkpoint.");
}

Json pieceJson(const CheckpointPiece& p) {
  return {{"offsets", p.offsets}, {"shape", p.shape}, {"file", p.file},
          {"byte_range", {p.begin, p.end}}, {"crc32", p.crc32}};
}

CheckpointPiece pieceOf(const Json& j) {
  CheckpointPiece p;
  p.offsets = j.at("offsets").get<std::vector<int64_t>>();
  p.shape = j.at("shape").get<std::vector<int64_t>>();
  p.file = j.at("file").get<std::string>();
  p.begin = j.at("byte_range").at(0).get<uint64_t>();
  p.end = j.at("byte_range").at(1).get<uint64_t>();
  p.crc32 = j.at("crc32").get<std::string>();
  return p;
}

// -1 when a size is negative or the product overflows (a corrupt index).
int64_t numelOf(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) {
    if (s < 0 || __builtin_mul_overflow(n, s, &n)) return -1;
  }
  return n;
}

bool overlap(const CheckpointPiece& a, const CheckpointPiece& b) {
  for (size_t d = 0; d < a.shape.size(); ++d) {
    if (a.offsets[d] + a.shape[d] <= b.offsets[d] || b.offsets[d] + b.shape[d] <= a.offsets[d]) return false;
  }
  return true;
}

}  // namespace

std::string CheckpointIndex::to_json() const {
  Json tensorsJson = Json::object();
  for (const auto& [name, t] : tensors) {
    Json pieces = Json::array();
    for (const auto& p : t.pieces) pieces.push_back(pieceJson(p));
    tensorsJson[name] = {{"dtype", safetensors_dtype_name(t.dtype)}, {"shape", t.shape}, {"pieces", pieces}};
  }
  Json j = {{"format", kFormat}, {"metadata", metadata}, {"files", files}, {"tensors", tensorsJson}};
  const std::string body = j.dump(1);
  j["checksum"] = crc32_of(body.data(), body.size());
  return j.dump(1);
}

CheckpointIndex CheckpointIndex::from_json(const std::string& text, const std::string& path) {
  CheckpointIndex index;
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, "load_checkpoint: '", path, "' is not valid JSON (", e.what(),
                "). The index is corrupt or cut short; load the previous checkpoint.");
  }
  std::string where = "the header";
  try {
    const std::string format = j.is_object() ? j.value("format", "(none)") : "(not an object)";
    TORCH_CHECK(format == kFormat || format == kFormatV1, "load_checkpoint: '", path, "' has format '", format,
                "', expected '", kFormat, "'. It was not written by dtp's checkpoint save, or its index is corrupt; "
                "load the previous checkpoint.");
    if (format == kFormat) {
      TORCH_CHECK(j.contains("checksum") && j.at("checksum").is_string(), "load_checkpoint: '", path,
                  "' has no \"checksum\" entry. The index is corrupt; load the previous checkpoint.");
      const std::string recorded = j.at("checksum").get<std::string>();
      j.erase("checksum");
      const std::string body = j.dump(1);
      TORCH_CHECK(crc32_of(body.data(), body.size()) == recorded, "load_checkpoint: '", path,
                  "' fails its checksum: the index was changed after it was written. The index is corrupt; load "
                  "the previous checkpoint.");
    }
    index.metadata = j.at("metadata").get<std::map<std::string, std::string>>();
    index.files = j.at("files").get<std::map<std::string, uint64_t>>();
    for (const auto& [name, t] : j.at("tensors").items()) {
      where = "tensor '" + name + "'";
      IndexedTensor it;
      it.dtype = dtypeOf(t.at("dtype").get<std::string>(), path, name);
      it.shape = t.at("shape").get<std::vector<int64_t>>();
      for (const auto& p : t.at("pieces")) it.pieces.push_back(pieceOf(p));
      index.tensors.emplace(name, std::move(it));
    }
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, "load_checkpoint: '", path, "': bad entry for ", where, " (", e.what(),
                "). The index is corrupt; load the previous checkpoint.");
  }
  // Each piece lies inside its tensor, in a listed file, with a byte range of
  // its size; together they tile the tensor (no overlap, no gap).
  for (const auto& [name, t] : index.tensors) {
    TORCH_CHECK(numelOf(t.shape) >= 0 && numelOf(t.shape) <= (int64_t{1} << 56), "load_checkpoint: '", path,
                "': tensor '", name, "' has shape ", c10::IntArrayRef(t.shape),
                ". The index is corrupt; load the previous checkpoint.");
    int64_t covered = 0;
    for (size_t i = 0; i < t.pieces.size(); ++i) {
      const auto& p = t.pieces[i];
      bool inside = p.offsets.size() == t.shape.size() && p.shape.size() == t.shape.size();
      for (size_t d = 0; inside && d < t.shape.size(); ++d) {
        inside = p.offsets[d] >= 0 && p.shape[d] > 0 && p.offsets[d] + p.shape[d] <= t.shape[d];
      }
      TORCH_CHECK(inside, "load_checkpoint: '", path, "': a piece of tensor '", name, "' at offsets ",
                  c10::IntArrayRef(p.offsets), " shape ", c10::IntArrayRef(p.shape), " lies outside its shape ",
                  c10::IntArrayRef(t.shape), ". The index is corrupt; load the previous checkpoint.");
      TORCH_CHECK(index.files.count(p.file), "load_checkpoint: '", path, "': tensor '", name, "' has a piece in '",
                  p.file, "', which the index does not list. The index is corrupt; load the previous checkpoint.");
      TORCH_CHECK(p.end >= p.begin && p.end - p.begin == numelOf(p.shape) * c10::elementSize(t.dtype),
                  "load_checkpoint: '", path, "': a piece of tensor '", name, "' has byte range [", p.begin, ", ",
                  p.end, ") for ", numelOf(p.shape), " elements. The index is corrupt; load the previous checkpoint.");
      for (size_t k = 0; k < i && t.pieces.size() <= 1024; ++k) {
        TORCH_CHECK(!overlap(p, t.pieces[k]), "load_checkpoint: '", path, "': two pieces of tensor '", name,
                    "' overlap (offsets ", c10::IntArrayRef(p.offsets), " and ", c10::IntArrayRef(t.pieces[k].offsets),
                    "). The index is corrupt; load the previous checkpoint.");
      }
      covered += numelOf(p.shape);
    }
    TORCH_CHECK(covered == numelOf(t.shape), "load_checkpoint: '", path, "': the pieces of tensor '", name,
                "' cover ", covered, " of its ", numelOf(t.shape), " elements. The index is corrupt or a rank's "
                "pieces are missing; load the previous checkpoint.");
  }
  return index;
}

std::string pieces_to_json(const std::vector<std::pair<std::string, CheckpointPiece>>& pieces) {
  Json j = Json::array();
  for (const auto& [name, p] : pieces) j.push_back({{"name", name}, {"piece", pieceJson(p)}});
  return j.dump();
}

std::vector<std::pair<std::string, CheckpointPiece>> pieces_from_json(const std::string& text) {
  std::vector<std::pair<std::string, CheckpointPiece>> out;
  for (const auto& e : Json::parse(text)) out.emplace_back(e.at("name").get<std::string>(), pieceOf(e.at("piece")));
  return out;
}

}  // namespace dtp::io
