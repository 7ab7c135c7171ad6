// safetensors writer and whole-file reader; the format is described in
// include/dtp/io/safetensors.h, random access in safetensors_file.h.
#include "dtp/io/safetensors.h"

#include "dtp/io/safetensors_file.h"
#include "io/crc32.h"
#include "io/file_util.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>

namespace dtp::io {
namespace {

using Json = nlohmann::ordered_json;

// See NOTE: [Tensor checksums] in src/io/safetensors_file.cpp.
constexpr const char* kChecksumPrefix = "dtp.crc32:";

// NOTE: [Nothing dtp did not write] (io/staged_dir.h) for single files: an
// existing file is replaced only when dtp wrote it, as its tensor checksums
// show. A file of another writer, one saved without checksums (dtp cannot
// tell it from another writer's) and anything not a file are refused.
void checkReplaceable(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return;
  TORCH_CHECK(S_ISREG(st.st_mode), "save_safetensors: '", path, "' exists and is not a file; dtp never replaces it. "
              "Save to another path, or move it away.");
  bool ours = false;
  try {
    const SafetensorsFile file(path);
    for (const auto& t : file.tensors()) ours |= !t.crc32.empty();
  } catch (const c10::Error&) {
  }
  TORCH_CHECK(ours, "save_safetensors: '", path, "' exists and was not written by dtp (no dtp tensor checksums), so "
              "dtp does not replace it. Save to another path, or remove the file yourself.");
}

}  // namespace

std::string encode_safetensors_header(const std::vector<HeaderEntry>& entries,
                                      const std::map<std::string, std::string>& metadata,
                                      std::vector<uint64_t>* data_offsets) {
  Json header = Json::object();
  if (!metadata.empty()) header["__metadata__"] = Json(metadata);
  uint64_t offset = 0;
  std::vector<uint64_t> begins;
  for (const auto& e : entries) {
    const char* dtype = safetensors_dtype_name(e.dtype);
    TORCH_INTERNAL_ASSERT(dtype, "encode_safetensors_header: unchecked dtype ", e.dtype);
    uint64_t nbytes = c10::elementSize(e.dtype);
    for (int64_t s : e.shape) nbytes *= static_cast<uint64_t>(s);
    header[e.name] = {{"dtype", dtype}, {"shape", e.shape}, {"data_offsets", {offset, offset + nbytes}}};
    begins.push_back(offset);
    offset += nbytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // Data starts 8-byte aligned, as the reference writes.
  std::string out(8, '\0');
  for (int b = 0; b < 8; ++b) out[b] = static_cast<char>(uint64_t{text.size()} >> (8 * b));
  out += text;
  if (data_offsets) {
    data_offsets->clear();
    for (uint64_t b : begins) data_offsets->push_back(out.size() + b);
  }
  return out;
}

SavedFile save_safetensors(
    const std::string& path,
    const TensorMap& tensors,
    const std::map<std::string, std::string>& metadata, bool checksums) {
  // Everything is checked before the first byte is written, so a bad entry
  // never costs the existing file.
  for (const auto& [k, v] : metadata) {
    TORCH_CHECK(k.rfind(kChecksumPrefix, 0) != 0, "save_safetensors: metadata key '", k, "' for '", path,
        "' starts with \"", kChecksumPrefix, "\", which is reserved for dtp's tensor checksums. Rename the key.");
  }
  auto meta = metadata;
  std::map<std::string, size_t> seen;
  std::vector<at::Tensor> data;
  std::vector<HeaderEntry> entries;
  std::vector<std::string> sums;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    TORCH_CHECK(!name.empty(), "save_safetensors: empty name for entry ", i, " of '", path,
        "'. Give every tensor a non-empty name.");
    TORCH_CHECK(name != "__metadata__", "save_safetensors: the name \"__metadata__\" (entry ", i, ") of '",
        path, "' is reserved for the metadata block. Rename the tensor.");
    auto [it, fresh] = seen.emplace(name, i);
    TORCH_CHECK(fresh, "save_safetensors: duplicate name '", name, "' for '", path, "': got it at entries ",
        it->second, " and ", i, ", expected unique names. Rename or drop one of them.");
    TORCH_CHECK(t.defined(), "save_safetensors: undefined tensor for '", name, "' (entry ", i, ") of '", path,
        "'. Pass a defined tensor or leave the entry out.");
    TORCH_CHECK(t.layout() == at::kStrided && t.has_storage(), "save_safetensors: tensor '", name,
        "' of '", path, "' has no dense storage (a DTensor, sparse or other wrapper tensor). "
        "Save t.full_tensor() or t.to_local() instead.");
    TORCH_CHECK(safetensors_dtype_name(t.scalar_type()), "save_safetensors: unsupported dtype for '", name, "' of '",
        path, "': got ", t.scalar_type(), ", expected one of F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL. "
        "Convert it first, e.g. t.to(at::kFloat).");
    at::Tensor c = t.to(at::kCPU).contiguous();
    entries.push_back({name, c.scalar_type(), c.sizes().vec()});
    sums.push_back(checksums ? crc32_of(c.data_ptr(), c.nbytes()) : std::string());
    if (checksums) meta[kChecksumPrefix + name] = sums.back();
    data.push_back(std::move(c));
  }
  SavedFile saved;
  std::vector<uint64_t> begins;
  const std::string header = encode_safetensors_header(entries, meta, &begins);
  saved.size = header.size();
  for (size_t i = 0; i < data.size(); ++i) {
    saved.tensors.push_back({entries[i].name, begins[i], begins[i] + data[i].nbytes(), sums[i]});
    saved.size += data[i].nbytes();
  }

  // NOTE: [Atomic checkpoint save] Write a sibling temp file, fsync it, then
  // rename(2) it over `path`: readers see the old file or the new one, never
  // a torn one, even if this process dies midway.
  checkReplaceable(path);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "save_safetensors: cannot create temporary file '", tmp, "' for '", path, "': ",
      errno_text(), errno == EEXIST ? ". dtp does not overwrite it; remove it if it is a leftover."
                                    : ". Check that the directory exists and is writable.");
  auto fail = [&](const std::string& what) {
    const std::string err = errno_text();
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, "save_safetensors: ", what, " for '", path, "': ", err,
        ". Check free disk space and permissions; any existing '", path, "' was left unchanged.");
  };
  if (!write_all(fd, header.data(), header.size())) fail("writing '" + tmp + "' failed");
  for (const auto& c : data) {
    if (!write_all(fd, c.data_ptr(), c.nbytes())) fail("writing '" + tmp + "' failed");
  }
  if (::fsync(fd) != 0) fail("fsync of '" + tmp + "' failed");
  const int closed = ::close(fd);
  fd = -1;
  if (closed != 0) fail("closing '" + tmp + "' failed");
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("renaming '" + tmp + "' over it failed");
  fsync_parent(path);
  return saved;
}

Checkpoint load_safetensors(const std::string& path) {
  SafetensorsFile file(path);
  Checkpoint ckpt;
  ckpt.metadata = file.metadata();
  for (const auto& e : file.tensors()) {
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
    const uint64_t nbytes = e.end - e.begin;
    if (nbytes > 0) file.read(e.begin, t.data_ptr(), nbytes);
    if (!e.crc32.empty()) {
      const std::string got = crc32_of(t.data_ptr(), nbytes);
      TORCH_CHECK(got == e.crc32, "load_safetensors: '", path, "': tensor '", e.name,
          "' fails its checksum: its bytes have CRC-32 ", got, ", the file recorded ", e.crc32,
          " when it was written. The file is corrupted (disk or copy error); load the previous checkpoint.");
    }
    if (e.dtype == at::kBool) {
      const auto* b = static_cast<const uint8_t*>(t.data_ptr());
      TORCH_CHECK(std::all_of(b, b + nbytes, [](uint8_t v) { return v <= 1; }), "load_safetensors: '", path,
          "': BOOL tensor '", e.name, "' holds bytes other than 0 and 1. The data is corrupt; re-save the checkpoint.");
    }
    ckpt.tensors.emplace_back(e.name, std::move(t));
  }
  return ckpt;
}

}  // namespace dtp::io
