// CRC-32 (zlib's) as dtp's checkpoints record it: 8 lowercase hex digits.
// See NOTE: [Tensor checksums] in src/io/safetensors_file.cpp.
#pragma once

#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <string>

namespace dtp::io {

inline uint32_t crc32_update(uint32_t crc, const void* data, uint64_t n) {
  return static_cast<uint32_t>(crc32_z(crc, static_cast<const Bytef*>(data), static_cast<z_size_t>(n)));
}

inline std::string crc32_hex(uint32_t crc) {
  char hex[9];
  std::snprintf(hex, sizeof(hex), "%08lx", static_cast<unsigned long>(crc));
  return hex;
}

inline std::string crc32_of(const void* data, uint64_t n) { return crc32_hex(crc32_update(0, data, n)); }

}  // namespace dtp::io
