// The safetensors reader: header checks once at open, data by pread. The
// format is described in include/dtp/io/safetensors.h.
#include "dtp/io/safetensors_file.h"

#include "io/crc32.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>
#include <tuple>

namespace dtp::io {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "NYI: safetensors IO on a big-endian host");

// ordered_json keeps the header's key order: the reader breaks offset ties
// (empty tensors) by that order.
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

std::string errnoText() { return std::error_code(errno, std::generic_category()).message(); }

// A header fragment for an error message, cut short: headers can be 100 MB.
std::string brief(const Json& j) {
  std::string s = j.dump();
  return s.size() <= 80 ? s : s.substr(0, 77) + "...";
}

}  // namespace

const char* safetensors_dtype_name(at::ScalarType t) {
  for (const auto& d : kDTypes) {
    if (d.type == t) return d.name;
  }
  return nullptr;
}

#define LOAD_CHECK(cond, ...) TORCH_CHECK(cond, "load_safetensors: '", path_, "': ", __VA_ARGS__)

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)) {
  struct stat st {};
  LOAD_CHECK(::stat(path_.c_str(), &st) == 0, "cannot open: ", errnoText(), ". Check the path and permissions.");
  LOAD_CHECK(S_ISREG(st.st_mode), "not a regular file. Pass the path of a .safetensors file.");
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  LOAD_CHECK(fd_ >= 0, "cannot open: ", errnoText(), ". Check the permissions.");
  // The destructor does not run when the constructor throws: close here.
  try {
    parse(static_cast<uint64_t>(st.st_size));
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

void SafetensorsFile::parse(uint64_t file_size) {
  size_ = file_size;
  LOAD_CHECK(size_ >= 8, "truncated: file has ", size_, " bytes, expected at least 8 (the header length). ",
      kCutShort, ".");
  unsigned char length[8];
  read(0, length, 8);
  uint64_t n = 0;
  for (int b = 7; b >= 0; --b) n = (n << 8) | length[b];
  LOAD_CHECK(n <= size_ - 8, "truncated: header says ", n, " bytes, file has ", size_ - 8,
      " after the 8-byte length. ", kCutShort, " (or it is not a safetensors file at all).");
  LOAD_CHECK(n <= kMaxHeaderBytes, "header of ", n, " bytes is larger than the ", kMaxHeaderBytes,
      "-byte limit of the reference reader. The file is corrupt or not a safetensors file.");
  std::string text(n, '\0');
  read(8, text.data(), n);

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

  const uint64_t dataStart = 8 + n;
  for (const auto& item : header.items()) {
    const std::string& key = item.key();  // named, not bound: lambdas below use them (C++17)
    const Json& val = item.value();
    if (key == "__metadata__") {
      LOAD_CHECK(val.is_object(), "__metadata__ is a JSON ", val.type_name(), ", expected an object of strings. ",
          kCorrupt, ".");
      for (const auto& [k, v] : val.items()) {
        LOAD_CHECK(v.is_string(), "non-string metadata for key '", k, "': got ", v.type_name(), " ", brief(v),
            ", expected a string. Store numbers and lists as strings (e.g. their JSON text) when saving.");
        metadata_[k] = v.get<std::string>();
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
    StoredTensor e;
    e.name = key;
    const Json& dtype = field("dtype");
    LOAD_CHECK(dtype.is_string() && scalarTypeOf(dtype.get<std::string>(), &e.dtype), "unknown dtype for tensor '",
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
    overflow |= __builtin_mul_overflow(numel, c10::elementSize(e.dtype), &nbytes);
    LOAD_CHECK(!overflow && e.end - e.begin == nbytes, "data_offsets ", brief(off),
        " do not match dtype and shape for tensor '", key, "': got ", e.end - e.begin, " bytes, expected ",
        overflow ? std::string("more than 2^64") : std::to_string(nbytes), " for ", dtype.get<std::string>(),
        brief(shape), ". ", kCorrupt, ".");
    tensors_.push_back(std::move(e));
  }

  // Tensors must tile the data area exactly, in offset order, as the reference
  // reader demands: no byte read twice (overlap) or never (gap).
  std::stable_sort(tensors_.begin(), tensors_.end(), [](const StoredTensor& a, const StoredTensor& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t pos = 0;
  for (const auto& e : tensors_) {
    LOAD_CHECK(e.begin == pos, e.begin < pos ? "overlapping" : "gap before", " data for tensor '", e.name,
        "': it starts at byte ", e.begin, ", expected ", pos, " (where the previous tensor ends). ", kCorrupt, ".");
    pos = e.end;
  }
  const uint64_t dataSize = size_ - dataStart;
  LOAD_CHECK(pos <= dataSize, "truncated: the header needs ", pos, " data bytes (file size ", dataStart + pos,
      "), file has ", dataSize, " (file size ", size_, "). ", kCutShort, ".");
  LOAD_CHECK(pos == dataSize, "file has ", dataSize - pos, " bytes after the last tensor: got ", dataSize,
      " data bytes, expected ", pos, ". The file is corrupt; re-save the checkpoint or load the previous one.");

  for (size_t i = 0; i < tensors_.size(); ++i) {
    auto& e = tensors_[i];
    e.begin += dataStart;
    e.end += dataStart;
    by_name_.emplace(e.name, i);
    auto sum = metadata_.find(kChecksumPrefix + e.name);
    if (sum != metadata_.end()) {
      e.crc32 = sum->second;
      metadata_.erase(sum);
    }
  }
  for (const auto& [k, v] : metadata_) {
    LOAD_CHECK(k.rfind(kChecksumPrefix, 0) != 0, "checksum '", k, "' names no tensor of the file. ", kCorrupt, ".");
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

const StoredTensor* SafetensorsFile::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

const StoredTensor& SafetensorsFile::at(const std::string& name) const {
  const StoredTensor* t = find(name);
  LOAD_CHECK(t != nullptr, "no tensor '", name, "' in this file. The index that points here is out of date or the "
      "file was replaced; re-save the checkpoint.");
  return *t;
}

void SafetensorsFile::read(uint64_t offset, void* dst, uint64_t n) const {
  char* p = static_cast<char*>(dst);
  uint64_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd_, p + done, std::min<uint64_t>(n - done, uint64_t{1} << 30),
                              static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    LOAD_CHECK(r >= 0, "read of bytes [", offset, ", ", offset + n, ") failed: ", errnoText(), ".");
    LOAD_CHECK(r > 0, "truncated: read ", done, " of ", n, " bytes at offset ", offset,
        " (did the file change while loading?). ", kCutShort, ".");
    done += static_cast<uint64_t>(r);
  }
}

std::string SafetensorsFile::crc32(uint64_t begin, uint64_t end, uint64_t buffer_bytes) const {
  std::vector<char> buf(std::min(end - begin, std::max<uint64_t>(buffer_bytes, 1)));
  uint32_t crc = crc32_update(0, nullptr, 0);
  for (uint64_t pos = begin; pos < end;) {
    const uint64_t n = std::min<uint64_t>(buf.size(), end - pos);
    read(pos, buf.data(), n);
    crc = crc32_update(crc, buf.data(), n);
    pos += n;
  }
  return crc32_hex(crc);
}

#undef LOAD_CHECK

}  // namespace dtp::io
