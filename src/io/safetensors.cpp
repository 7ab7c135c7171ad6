// safetensors reader and writer; the format is described in
// include/dtp/io/safetensors.h.
#include "dtp/io/safetensors.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <zlib.h>
#include <system_error>
#include <tuple>

namespace dtp::io {
namespace {

// Raw tensor bytes go to and from disk unchanged, and the format is little-endian.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "NYI: safetensors IO on a big-endian host");

// ordered_json keeps the header's key order: the writer emits tensors in the
// order given, and the reader breaks offset ties (empty tensors) by that order.
using Json = nlohmann::ordered_json;

// The reference reader's limit, kept so a garbage length cannot make us
// allocate gigabytes for a "header".
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Real headers nest 3 deep ({name: {shape: [..]}}); the limit keeps error
// messages (which print header fragments recursively) away from deep stacks.
constexpr int kMaxHeaderDepth = 8;

// NOTE: [Tensor checksums] dtp stores a CRC-32 of each tensor's bytes in the
// metadata, under "dtp.crc32:<name>" (metadata is the format's only place for
// extras; other readers ignore it), and verifies it on load: a flipped byte
// in the data is an error naming the tensor instead of a silently wrong
// weight. Files without checksums (written by other tools) load as before.
constexpr const char* kChecksumPrefix = "dtp.crc32:";

std::string crc32Of(const void* data, uint64_t n) {
  uLong crc = crc32_z(0L, Z_NULL, 0);
  crc = crc32_z(crc, static_cast<const Bytef*>(data), static_cast<z_size_t>(n));
  char hex[9];
  std::snprintf(hex, sizeof(hex), "%08lx", static_cast<unsigned long>(crc & 0xffffffffUL));
  return hex;
}

constexpr const char* kCutShort =
    "The file was probably cut short while being written (crash, full disk, interrupted copy); "
    "re-save it or load the previous checkpoint";
constexpr const char* kCorrupt = "The header is corrupt; re-save the checkpoint or load the previous one";

struct DTypeName {
  const char* name;
  at::ScalarType type;
};
constexpr DTypeName kDTypes[] = {
    {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf}, {"BF16", at::kBFloat16},
    {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
    {"U8", at::kByte},    {"BOOL", at::kBool},
};

const char* safetensorsName(at::ScalarType t) {
  for (const auto& d : kDTypes) {
    if (d.type == t) return d.name;
  }
  return nullptr;
}

bool scalarTypeOf(const std::string& name, at::ScalarType* out) {
  for (const auto& d : kDTypes) {
    if (name == d.name) {
      *out = d.type;
      return true;
    }
  }
  return false;
}

std::string supportedNames() {
  std::string s;
  for (const auto& d : kDTypes) s += (s.empty() ? "" : ", ") + std::string(d.name);
  return s;
}

std::string errnoText() {
  return std::error_code(errno, std::generic_category()).message();
}

// A header fragment for an error message, cut short: headers can be 100 MB.
std::string brief(const Json& j) {
  std::string s = j.dump();
  return s.size() <= 80 ? s : s.substr(0, 77) + "...";
}

bool writeAll(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      if (w == 0) errno = EIO;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

}  // namespace

void save_safetensors(
    const std::string& path,
    const TensorMap& tensors,
    const std::map<std::string, std::string>& metadata, bool checksums) {
  // Everything is checked before the first byte is written, so a bad entry
  // never costs the existing file.
  Json header = Json::object();
  for (const auto& [k, v] : metadata) {
    TORCH_CHECK(k.rfind(kChecksumPrefix, 0) != 0, "save_safetensors: metadata key '", k, "' for '", path,
        "' starts with \"", kChecksumPrefix, "\", which is reserved for dtp's tensor checksums. Rename the key.");
  }
  Json meta(metadata);
  if (!metadata.empty() || (checksums && !tensors.empty())) header["__metadata__"] = Json::object();
  std::map<std::string, size_t> seen;
  std::vector<at::Tensor> data;
  uint64_t offset = 0;
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
    const char* dtype = safetensorsName(t.scalar_type());
    TORCH_CHECK(dtype, "save_safetensors: unsupported dtype for '", name, "' of '", path, "': got ",
        t.scalar_type(), ", expected one of ", supportedNames(), ". Convert it first, e.g. t.to(at::kFloat).");
    at::Tensor c = t.to(at::kCPU).contiguous();
    const uint64_t nbytes = c.nbytes();
    header[name] = {{"dtype", dtype}, {"shape", c.sizes().vec()}, {"data_offsets", {offset, offset + nbytes}}};
    if (checksums) meta[kChecksumPrefix + name] = crc32Of(c.data_ptr(), nbytes);
    offset += nbytes;
    data.push_back(std::move(c));
  }
  if (header.contains("__metadata__")) header["__metadata__"] = std::move(meta);
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // Data starts 8-byte aligned, as the reference writes.
  unsigned char length[8];
  for (int b = 0; b < 8; ++b) length[b] = static_cast<unsigned char>(uint64_t{text.size()} >> (8 * b));

  // NOTE: [Atomic checkpoint save] Write a sibling temp file, fsync it, then
  // rename(2) it over `path`: readers see the old file or the new one, never
  // a torn one, even if this process dies midway.
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "save_safetensors: cannot create temporary file '", tmp, "' for '", path, "': ",
      errnoText(), ". Check that the directory exists and is writable.");
  auto fail = [&](const std::string& what) {
    const std::string err = errnoText();
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, "save_safetensors: ", what, " for '", path, "': ", err,
        ". Check free disk space and permissions; any existing '", path, "' was left unchanged.");
  };
  if (!writeAll(fd, length, 8) || !writeAll(fd, text.data(), text.size())) fail("writing '" + tmp + "' failed");
  for (const auto& c : data) {
    if (!writeAll(fd, c.data_ptr(), c.nbytes())) fail("writing '" + tmp + "' failed");
  }
  if (::fsync(fd) != 0) fail("fsync of '" + tmp + "' failed");
  const int closed = ::close(fd);
  fd = -1;
  if (closed != 0) fail("closing '" + tmp + "' failed");
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("renaming '" + tmp + "' over it failed");
  // Best effort: persist the rename itself (some filesystems refuse to fsync a directory).
  const size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

#define LOAD_CHECK(cond, ...) TORCH_CHECK(cond, "load_safetensors: '", path, "': ", __VA_ARGS__)

Checkpoint load_safetensors(const std::string& path) {
  struct stat st {};
  LOAD_CHECK(::stat(path.c_str(), &st) == 0, "cannot open: ", errnoText(), ". Check the path and permissions.");
  LOAD_CHECK(S_ISREG(st.st_mode), "not a regular file. Pass the path of a .safetensors file.");
  std::ifstream in(path, std::ios::binary);
  LOAD_CHECK(in.is_open(), "cannot open: ", errnoText(), ". Check the permissions.");
  const uint64_t fileSize = static_cast<uint64_t>(st.st_size);
  LOAD_CHECK(fileSize >= 8, "truncated: file has ", fileSize, " bytes, expected at least 8 (the header length). ",
      kCutShort, ".");
  unsigned char length[8];
  in.read(reinterpret_cast<char*>(length), 8);
  uint64_t n = 0;
  for (int b = 7; b >= 0; --b) n = (n << 8) | length[b];
  LOAD_CHECK(n <= fileSize - 8, "truncated: header says ", n, " bytes, file has ", fileSize - 8,
      " after the 8-byte length. ", kCutShort, " (or it is not a safetensors file at all).");
  LOAD_CHECK(n <= kMaxHeaderBytes, "header of ", n, " bytes is larger than the ", kMaxHeaderBytes,
      "-byte limit of the reference reader. The file is corrupt or not a safetensors file.");
  std::string text(n, '\0');
  in.read(text.data(), static_cast<std::streamsize>(n));
  LOAD_CHECK(static_cast<uint64_t>(in.gcount()) == n, "truncated: read ", in.gcount(), " of ", n,
      " header bytes (did the file change while loading?). ", kCutShort, ".");

  // nlohmann keeps one value for a repeated key, so repeats are caught while
  // parsing: a repeated tensor name would otherwise lose a tensor silently.
  std::vector<std::set<std::string>> keys;  // one set per open object
  std::string duplicate;
  auto onEvent = [&](int depth, Json::parse_event_t event, Json& value) {
    LOAD_CHECK(depth <= kMaxHeaderDepth, "header nests deeper than ", kMaxHeaderDepth, " levels. ", kCorrupt, ".");
    if (event == Json::parse_event_t::object_start) keys.emplace_back();
    if (event == Json::parse_event_t::object_end) keys.pop_back();
    if (event == Json::parse_event_t::key && !keys.back().insert(value.get<std::string>()).second &&
        duplicate.empty()) {
      duplicate = value.get<std::string>();
    }
    return true;
  };
  Json header;
  try {
    header = Json::parse(text, onEvent);
  } catch (const nlohmann::json::exception& e) {
    LOAD_CHECK(false, "header is not valid JSON: ", e.what(), ". ", kCorrupt, ".");
  }
  LOAD_CHECK(duplicate.empty(), "duplicate key '", duplicate, "' in the header: got it twice, expected unique "
      "tensor names and fields. ", kCorrupt, ".");
  LOAD_CHECK(header.is_object(), "header is a JSON ", header.type_name(), ", expected an object. ", kCorrupt, ".");

  struct Entry {
    std::string name;
    at::ScalarType type;
    std::vector<int64_t> shape;
    uint64_t begin, end;
  };
  std::vector<Entry> entries;
  Checkpoint ckpt;
  for (const auto& item : header.items()) {
    const std::string& key = item.key();  // named, not bound: lambdas below use them (C++17)
    const Json& val = item.value();
    if (key == "__metadata__") {
      LOAD_CHECK(val.is_object(), "__metadata__ is a JSON ", val.type_name(), ", expected an object of strings. ",
          kCorrupt, ".");
      for (const auto& [k, v] : val.items()) {
        LOAD_CHECK(v.is_string(), "non-string metadata for key '", k, "': got ", v.type_name(), " ", brief(v),
            ", expected a string. Store numbers and lists as strings (e.g. their JSON text) when saving.");
        ckpt.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    LOAD_CHECK(val.is_object(), "entry for tensor '", key, "' is a JSON ", val.type_name(),
        ", expected an object with dtype, shape and data_offsets. ", kCorrupt, ".");
    auto field = [&](const char* f) -> const Json& {
      auto it = val.find(f);
      LOAD_CHECK(it != val.end(), "no \"", f, "\" for tensor '", key, "'. ", kCorrupt, ".");
      return *it;
    };
    Entry e{key, at::kFloat, {}, 0, 0};
    const Json& dtype = field("dtype");
    LOAD_CHECK(dtype.is_string() && scalarTypeOf(dtype.get<std::string>(), &e.type), "unknown dtype for tensor '",
        key, "': got ", brief(dtype), ", expected one of ", supportedNames(),
        ". Convert the tensor to a supported dtype before saving (F8, U16, U32, U64 are NYI).");
    const Json& shape = field("shape");
    LOAD_CHECK(shape.is_array(), "bad shape for tensor '", key, "': got ", brief(shape),
        ", expected a list of sizes. ", kCorrupt, ".");
    uint64_t numel = 1;
    bool overflow = false;
    for (const auto& d : shape) {
      LOAD_CHECK(d.is_number_unsigned() && d.get<uint64_t>() <= std::numeric_limits<int64_t>::max(),
          "bad shape for tensor '", key, "': got ", brief(shape), ", expected non-negative integers. ", kCorrupt, ".");
      e.shape.push_back(d.get<int64_t>());
      overflow |= __builtin_mul_overflow(numel, d.get<uint64_t>(), &numel);
    }
    const Json& off = field("data_offsets");
    LOAD_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned() &&
            off[0].get<uint64_t>() <= off[1].get<uint64_t>(),
        "bad data_offsets for tensor '", key, "': got ", brief(off), ", expected [begin, end] with begin <= end. ",
        kCorrupt, ".");
    e.begin = off[0].get<uint64_t>();
    e.end = off[1].get<uint64_t>();
    uint64_t nbytes = 0;
    overflow |= __builtin_mul_overflow(numel, c10::elementSize(e.type), &nbytes);
    LOAD_CHECK(!overflow && e.end - e.begin == nbytes, "data_offsets ", brief(off),
        " do not match dtype and shape for tensor '", key, "': got ", e.end - e.begin, " bytes, expected ",
        overflow ? std::string("more than 2^64") : std::to_string(nbytes), " for ", dtype.get<std::string>(),
        brief(shape), ". ", kCorrupt, ".");
    entries.push_back(std::move(e));
  }

  // Tensors must tile the data area exactly, in offset order, as the reference
  // reader demands: no byte read twice (overlap) or never (gap).
  std::stable_sort(entries.begin(), entries.end(),
      [](const Entry& a, const Entry& b) { return std::tie(a.begin, a.end) < std::tie(b.begin, b.end); });
  uint64_t pos = 0;
  for (const auto& e : entries) {
    LOAD_CHECK(e.begin == pos, e.begin < pos ? "overlapping" : "gap before", " data for tensor '", e.name,
        "': it starts at byte ", e.begin, ", expected ", pos, " (where the previous tensor ends). ", kCorrupt, ".");
    pos = e.end;
  }
  const uint64_t dataSize = fileSize - 8 - n;
  LOAD_CHECK(pos <= dataSize, "truncated: the header needs ", pos, " data bytes (file size ", 8 + n + pos,
      "), file has ", dataSize, " (file size ", fileSize, "). ", kCutShort, ".");
  LOAD_CHECK(pos == dataSize, "file has ", dataSize - pos, " bytes after the last tensor: got ", dataSize,
      " data bytes, expected ", pos, ". The file is corrupt; re-save the checkpoint or load the previous one.");

  for (const auto& e : entries) {
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.type));
    const uint64_t nbytes = e.end - e.begin;
    if (nbytes > 0) in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(nbytes));
    LOAD_CHECK(nbytes == 0 || static_cast<uint64_t>(in.gcount()) == nbytes, "truncated: read ", in.gcount(),
        " of ", nbytes, " bytes for tensor '", e.name, "' (did the file change while loading?). ", kCutShort, ".");
    auto sum = ckpt.metadata.find(kChecksumPrefix + e.name);
    if (sum != ckpt.metadata.end()) {
      const std::string got = crc32Of(t.data_ptr(), nbytes);
      LOAD_CHECK(got == sum->second, "tensor '", e.name, "' fails its checksum: its bytes have CRC-32 ", got,
          ", the file recorded ", sum->second, " when it was written. The file is corrupted (disk or copy "
          "error); load the previous checkpoint.");
      ckpt.metadata.erase(sum);
    }
    if (e.type == at::kBool) {
      const auto* b = static_cast<const uint8_t*>(t.data_ptr());
      LOAD_CHECK(std::all_of(b, b + nbytes, [](uint8_t v) { return v <= 1; }), "BOOL tensor '", e.name,
          "' holds bytes other than 0 and 1. The data is corrupt; re-save the checkpoint.");
    }
    ckpt.tensors.emplace_back(e.name, std::move(t));
  }
  for (const auto& [k, v] : ckpt.metadata) {
    LOAD_CHECK(k.rfind(kChecksumPrefix, 0) != 0, "checksum '", k, "' names no tensor of the file. ", kCorrupt, ".");
  }
  return ckpt;
}

#undef LOAD_CHECK

}  // namespace dtp::io
