// Random access to one safetensors file: the header is read and checked in
// full when the file opens (the same checks as load_safetensors), the data is
// read only where asked, by pread. Sharded checkpoints and Hugging Face
// folders load through it, each rank reading only the bytes of its shards.
//
//   io::SafetensorsFile f("model-00001-of-00002.safetensors");
//   const io::StoredTensor& w = f.at("model.norm.weight");   // dtype, shape, bytes
//   io::read_box(f, w, /*start=*/{0}, local);                 // see box_io.h
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace dtp::io {

// A row-major, little-endian tensor at bytes [begin, end) of a file
// (absolute offsets, header included).
struct StoredTensor {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
  std::string crc32;  // dtp's recorded checksum (NOTE: [Tensor checksums]); empty when none
};

class SafetensorsFile {
 public:
  // Opens and validates the header; errors name the file and the fix.
  explicit SafetensorsFile(std::string path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  // In data order.
  const std::vector<StoredTensor>& tensors() const { return tensors_; }
  // Without dtp's checksum entries.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const StoredTensor* find(const std::string& name) const;
  // Throws naming the file and the tensor when absent.
  const StoredTensor& at(const std::string& name) const;
  // Reads bytes [offset, offset + n); a short read is a "truncated" error.
  void read(uint64_t offset, void* dst, uint64_t n) const;
  // The CRC-32 of bytes [begin, end), streamed through `buffer_bytes`.
  std::string crc32(uint64_t begin, uint64_t end, uint64_t buffer_bytes) const;

 private:
  void parse(uint64_t file_size);  // the header checks of the constructor
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  std::vector<StoredTensor> tensors_;
  std::map<std::string, size_t> by_name_;
  std::map<std::string, std::string> metadata_;
};

// The safetensors dtype name ("F32", "BF16"...) of `t`, or nullptr when the
// format cannot hold it.
const char* safetensors_dtype_name(at::ScalarType t);

}  // namespace dtp::io
