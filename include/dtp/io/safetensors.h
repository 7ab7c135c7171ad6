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

// Writes atomically: to "<path>.tmp.<pid>", fsync, then rename over `path`, so
// a crash or error leaves any existing file at `path` untouched and no
// temporary file behind. Names must be unique, non-empty and not
// "__metadata__"; tensors must be defined and of a supported dtype.
// `checksums` records a CRC-32 of every tensor in the metadata
// ("dtp.crc32:<name>"; other readers ignore it); without them the bytes are
// exactly the reference writer's.
void save_safetensors(
    const std::string& path,
    const TensorMap& tensors,
    const std::map<std::string, std::string>& metadata = {},
    bool checksums = true);

// Reads and validates a whole file; tensors come back on CPU, contiguous. A
// tensor whose recorded checksum does not match its bytes is an error naming
// it; checksum entries are not returned in `metadata`.
Checkpoint load_safetensors(const std::string& path);

}  // namespace dtp::io
