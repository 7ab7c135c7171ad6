// Checkpoints in the safetensors format (huggingface/safetensors), readable by
// the Python `safetensors` library and writable from it:
//
//   [u64 little-endian N][N bytes of JSON header, space-padded to 8][raw data]
//   header: {"__metadata__": {"k": "v"},
//            "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}
//
// Offsets are relative to the first data byte; tensors are packed back to back
// in C order, little-endian. Supported dtypes: F64 F32 F16 BF16 I64 I32 I16 I8
// U8 BOOL. Unlike the Python writer, which reorders tensors by dtype and name,
// save_safetensors keeps the order it is given.
//
// Unlike pickle checkpoints, loading runs no code: a file is checked in full
// (header length, JSON, dtypes, shapes against offsets, offsets packed
// without gap or overlap and covering the data exactly, unique names,
// string-only metadata) before any tensor is allocated. Every error names the
// file and says how to fix it; a file cut short while being written is
// reported as "truncated". Unknown keys inside a tensor entry are ignored, as
// the reference reader does.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace dtp::io {

// Ordered name -> tensor. Tensors on another device are copied to CPU and
// non-contiguous ones are made contiguous by the writer.
using TensorMap = std::vector<std::pair<std::string, at::Tensor>>;

struct Checkpoint {
  TensorMap tensors;  // in file order (by data offset)
  std::map<std::string, std::string> metadata;
};

// Where save_safetensors put each tensor: absolute byte range in the file
// and the CRC-32 of its bytes (NOTE: [Tensor checksums]; empty when saved
// without checksums).
struct SavedTensor {
  std::string name;
  uint64_t begin = 0, end = 0;
  std::string crc32;
};
struct SavedFile {
  uint64_t size = 0;
  std::vector<SavedTensor> tensors;
};

// Writes atomically: to "<path>.tmp.<pid>", fsync, then rename over `path`, so
// a crash or error leaves any existing file at `path` untouched and no
// temporary file behind. An existing `path` is replaced only when dtp wrote
// it (it has dtp's checksums); any other file is an error, left as it was.
// Names must be unique, non-empty and not "__metadata__"; tensors must be
// defined and of a supported dtype.
// `checksums` records a CRC-32 of every tensor in the metadata
// ("dtp.crc32:<name>"; other readers ignore it); without them the bytes are
// exactly the reference writer's.
SavedFile save_safetensors(
    const std::string& path,
    const TensorMap& tensors,
    const std::map<std::string, std::string>& metadata = {},
    bool checksums = true);

// Reads and validates a whole file; tensors come back on CPU, contiguous. A
// tensor whose recorded checksum does not match its bytes is an error naming
// it; checksum entries are not returned in `metadata`.
Checkpoint load_safetensors(const std::string& path);

// The 8-byte length and the JSON header (space-padded to 8) of a file holding
// `entries` back to back in order; `data_offsets` receives each tensor's
// absolute first byte. For writers that fill the data themselves (pwrite by
// several ranks).
struct HeaderEntry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};
std::string encode_safetensors_header(const std::vector<HeaderEntry>& entries,
                                      const std::map<std::string, std::string>& metadata,
                                      std::vector<uint64_t>* data_offsets);

}  // namespace dtp::io
