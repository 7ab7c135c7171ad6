// The index of a sharded checkpoint folder (index.json): for each global
// tensor its dtype, global shape and the pieces that tile it, each a
// row-major block stored whole as one tensor of a safetensors file.
//
//   {"format": "dtp-checkpoint-2", "checksum": "5f0c2a91", "metadata": {"step": "100"},
//    "files": {"rank-00000.safetensors": 4096, ...},           // sizes in bytes
//    "tensors": {"layers.0.attention.wq.weight": {"dtype": "F32", "shape": [64, 64],
//       "pieces": [{"offsets": [0, 0], "shape": [32, 64], "file": "rank-00000.safetensors",
//                   "byte_range": [128, 8320], "crc32": "1c291ca3"}, ...]}}}
//
// Byte ranges are absolute offsets into the file (header included), so a
// reader seeks straight to the bytes it needs. "checksum" is the CRC-32 of
// the index's JSON without it (dumped as to_json does): a change anywhere in
// the index, a metadata key included, is an error on load. Indexes of format
// dtp-checkpoint-1 (no checksum) still load.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dtp::io {

struct CheckpointPiece {
  std::vector<int64_t> offsets, shape;
  std::string file;
  uint64_t begin = 0, end = 0;
  std::string crc32;
};

struct IndexedTensor {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  std::vector<CheckpointPiece> pieces;
};

struct CheckpointIndex {
  static constexpr const char* kFormat = "dtp-checkpoint-2";
  static constexpr const char* kFormatV1 = "dtp-checkpoint-1";
  static constexpr const char* kFileName = "index.json";
  std::map<std::string, std::string> metadata;
  std::map<std::string, uint64_t> files;
  std::map<std::string, IndexedTensor> tensors;

  std::string to_json() const;
  // Parses and checks everything (types, dtypes, pieces inside their tensor
  // and tiling it exactly, files listed); errors name `path` and the entry.
  static CheckpointIndex from_json(const std::string& text, const std::string& path);
};

// One piece as JSON text and back, for ranks to send their pieces to the
// rank that writes the index.
std::string pieces_to_json(const std::vector<std::pair<std::string, CheckpointPiece>>& pieces);
std::vector<std::pair<std::string, CheckpointPiece>> pieces_from_json(const std::string& text);

}  // namespace dtp::io
