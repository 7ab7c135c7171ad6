// Reading and writing a box of a stored tensor: the part of a row-major
// tensor in a file that one rank's shard covers, without touching the rest.
//
//   stored f32[8,6], box start {2, 3}, dst [3, 2] -> rows 2..4, columns 3..4:
//   three runs of 2 elements, one pread each.
//
// NOTE: [Bounded box IO] A box is read as runs of contiguous bytes into a
// buffer of at most `buffer_bytes` (a box larger than that is split along its
// outermost dimension of size > 1 until each part fits), then copied into
// `dst` with a cast to dst's dtype. So a rank's memory while loading is its
// shards plus one buffer, never a whole tensor or model.
#pragma once

#include "dtp/io/safetensors_file.h"

#include <c10/util/ArrayRef.h>

namespace dtp::io {

constexpr uint64_t kDefaultBufferBytes = uint64_t{16} << 20;

// dst <- stored[start : start + dst.sizes()], cast to dst's dtype; dst may be
// strided (a view into a larger tensor) and on any device.
void read_box(const SafetensorsFile& file, const StoredTensor& stored, c10::IntArrayRef start, at::Tensor dst,
              uint64_t buffer_bytes = kDefaultBufferBytes);

// stored[start : start + src.sizes()] <- src cast to stored.dtype, by pwrite
// into the open file `fd` (named `path` in errors).
void write_box(int fd, const std::string& path, const StoredTensor& stored, c10::IntArrayRef start,
               const at::Tensor& src, uint64_t buffer_bytes = kDefaultBufferBytes);

}  // namespace dtp::io
