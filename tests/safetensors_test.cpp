// safetensors checkpoints: round trips, byte-for-byte agreement with the
// reference (Python/Rust) writer, and a loud, path-naming error for every
// kind of damaged file and failed save.
#include "dist.h"
#include "files.h"

#include "dtp/io/safetensors.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>

using dtp::io::load_safetensors;
using dtp::io::save_safetensors;
using dtp::io::TensorMap;

namespace {

namespace fs = std::filesystem;

#define EXPECT_ERROR(stmt, text) \
  EXPECT_NE(dtp::test::any_error_of([&] { stmt; }).find(text), std::string::npos) << dtp::test::any_error_of([&] { stmt; })

std::string bytes(std::initializer_list<unsigned char> b) {
  return std::string(b.begin(), b.end());
}

std::string lengthPrefix(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(n >> (8 * i));
  return s;
}

// 2x3 values that exercise sign and fractions where the dtype has them.
at::Tensor sample(at::ScalarType t) {
  at::Tensor x = at::arange(6, at::kDouble).reshape({2, 3});
  if (t == at::kBool) return (x.fmod(2) == 0);
  if (t == at::kByte) return (x * 40).to(t);
  return (at::isFloatingType(t) ? x * 0.75 - 2 : x - 3).to(t);
}

class SafetensorsTest : public dtp::test::TempDirTest {
 protected:
  // Writes a file the way the reference writer frames one: length, JSON
  // padded with spaces to 8 bytes, data.
  std::string raw(const std::string& json, const std::string& data, const std::string& name = "raw.safetensors") {
    std::string header = json + std::string((8 - json.size() % 8) % 8, ' ');
    dtp::test::write_bytes(file(name), lengthPrefix(header.size()) + header + data);
    return file(name);
  }

  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
};

TEST_F(SafetensorsTest, RoundTripsEveryDtypeInGivenOrder) {
  const std::vector<std::pair<std::string, at::ScalarType>> types = {
      {"z.f32", at::kFloat}, {"y.f64", at::kDouble}, {"x.f16", at::kHalf}, {"w.bf16", at::kBFloat16},
      {"v.i64", at::kLong},  {"u.i32", at::kInt},    {"t.i16", at::kShort}, {"s.i8", at::kChar},
      {"r.u8", at::kByte},   {"q.bool", at::kBool}};
  TensorMap tensors;
  for (const auto& [name, type] : types) tensors.emplace_back(name, sample(type));
  save_safetensors(file("all.safetensors"), tensors);

  auto ckpt = load_safetensors(file("all.safetensors"));
  ASSERT_EQ(ckpt.tensors.size(), types.size());
  EXPECT_TRUE(ckpt.metadata.empty());
  for (size_t i = 0; i < types.size(); ++i) {
    const auto& [name, t] = ckpt.tensors[i];
    EXPECT_EQ(name, types[i].first);
    EXPECT_EQ(t.scalar_type(), types[i].second) << name;
    EXPECT_EQ(t.sizes(), at::IntArrayRef({2, 3})) << name;
    EXPECT_TRUE(at::equal(t, sample(types[i].second))) << name << "\n" << t;
  }
  // Values really are distinct per element, so a shifted or swapped read would fail.
  EXPECT_FLOAT_EQ(ckpt.tensors[0].second[1][2].item<float>(), 1.75f);
  EXPECT_EQ(ckpt.tensors[4].second[0][0].item<int64_t>(), -3);
}

TEST_F(SafetensorsTest, RoundTripsZeroDimEmptyAndNonContiguous) {
  at::Tensor base = at::arange(12, at::kFloat).reshape({3, 4});
  TensorMap tensors = {
      {"scalar", at::scalar_tensor(3.5, at::kDouble)},
      {"empty", at::empty({0}, at::kFloat)},
      {"empty3d", at::empty({3, 0, 2}, at::kInt)},
      {"transposed", base.t()},
      {"strided", at::arange(10, at::kLong).slice(0, 0, 10, 3)},
      {"expanded", at::arange(3, at::kShort).reshape({1, 3}).expand({4, 3})},
      {"bf16.t", base.to(at::kBFloat16).t()},
  };
  ASSERT_FALSE(tensors[3].second.is_contiguous());
  ASSERT_FALSE(tensors[5].second.is_contiguous());
  save_safetensors(file("shapes.safetensors"), tensors);

  auto ckpt = load_safetensors(file("shapes.safetensors"));
  ASSERT_EQ(ckpt.tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = ckpt.tensors[i];
    EXPECT_EQ(name, tensors[i].first);
    EXPECT_EQ(t.sizes(), tensors[i].second.sizes()) << name;
    EXPECT_TRUE(t.is_contiguous()) << name;
    EXPECT_TRUE(at::equal(t, tensors[i].second)) << name;
  }
  EXPECT_EQ(ckpt.tensors[0].second.dim(), 0);
  EXPECT_EQ(ckpt.tensors[0].second.item<double>(), 3.5);
  EXPECT_EQ(ckpt.tensors[3].second[0][2].item<float>(), 8.0f);  // base.t()[0][2] == base[2][0]
}

TEST_F(SafetensorsTest, RoundTripsMetadata) {
  std::map<std::string, std::string> meta = {
      {"format", "pt"}, {"step", "1200"}, {"note", "quotes \" and ünïcode"}, {"empty", ""}};
  save_safetensors(file("meta.safetensors"), {{"w", at::ones({2})}}, meta);
  auto ckpt = load_safetensors(file("meta.safetensors"));
  EXPECT_EQ(ckpt.metadata, meta);
  ASSERT_EQ(ckpt.tensors.size(), 1u);

  // Only metadata, no tensors.
  save_safetensors(file("only_meta.safetensors"), {}, {{"k", "v"}});
  auto only = load_safetensors(file("only_meta.safetensors"));
  EXPECT_TRUE(only.tensors.empty());
  EXPECT_EQ(only.metadata.at("k"), "v");
}

// The expected bytes are the reference implementation's own serialization
// tests (huggingface/safetensors, safetensors/src/tensor.rs); dtp's checksums
// off, as the reference writes none.
TEST_F(SafetensorsTest, WritesTheSameBytesAsTheReferenceWriter) {
  const std::string floats = bytes({0, 0, 0, 0, 0, 0, 128, 63, 0, 0, 0, 64, 0, 0, 64, 64, 0, 0, 128, 64, 0, 0, 160, 64});
  save_safetensors(file("a.safetensors"), {{"attn0", at::arange(6, at::kFloat).reshape({1, 1, 2, 3})}}, {}, /*checksums=*/false);
  EXPECT_EQ(dtp::test::read_bytes(file("a.safetensors")),
      lengthPrefix(72) + R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})" + "       " + floats);

  save_safetensors(file("b.safetensors"), {{"attn.0", at::arange(6, at::kFloat).reshape({1, 2, 3})}}, {}, false);
  EXPECT_EQ(dtp::test::read_bytes(file("b.safetensors")),
      lengthPrefix(64) + R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})" + floats);

  save_safetensors(file("c.safetensors"), {});
  EXPECT_EQ(dtp::test::read_bytes(file("c.safetensors")), lengthPrefix(8) + "{}      ");
  save_safetensors(file("d.safetensors"), {}, {{"framework", "pt"}}, false);
  EXPECT_EQ(dtp::test::read_bytes(file("d.safetensors")), lengthPrefix(40) + R"({"__metadata__":{"framework":"pt"}})" + "     ");
}

// Built byte by byte as Python's
//   save_file({"b": torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
//              "a": torch.tensor([1.5, -2.0])}, path, metadata={"format": "pt"})
// writes it: metadata first, tensors by descending dtype then name, 144-byte
// padded header.
TEST_F(SafetensorsTest, LoadsFileWrittenByPythonSafetensors) {
  const std::string json = R"({"__metadata__":{"format":"pt"},)"
                           R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"I32","shape":[2,2],"data_offsets":[8,24]}})";
  ASSERT_EQ(json.size(), 141u);
  const std::string data = bytes({0, 0, 0xc0, 0x3f, 0, 0, 0, 0xc0,  // 1.5f, -2.0f
      1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0});
  dtp::test::write_bytes(file("py.safetensors"), lengthPrefix(144) + json + "   " + data);

  auto ckpt = load_safetensors(file("py.safetensors"));
  EXPECT_EQ(ckpt.metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(ckpt.tensors.size(), 2u);
  EXPECT_EQ(ckpt.tensors[0].first, "a");
  EXPECT_TRUE(at::equal(ckpt.tensors[0].second, at::tensor({1.5f, -2.0f})));
  EXPECT_EQ(ckpt.tensors[1].first, "b");
  EXPECT_TRUE(at::equal(ckpt.tensors[1].second, at::tensor({1, 2, 3, 4}, at::kInt).reshape({2, 2})));
}

TEST_F(SafetensorsTest, LoadsUnpaddedHeaderAndReturnsTensorsInOffsetOrder) {
  // Older writers did not pad, and listed tensors in any order.
  const std::string json = R"({"late":{"dtype":"U8","shape":[2],"data_offsets":[4,6]},)"
                           R"("early":{"dtype":"I16","shape":[2],"data_offsets":[0,4]}})";
  dtp::test::write_bytes(file("old.safetensors"), lengthPrefix(json.size()) + json + bytes({0xff, 0xff, 7, 0, 9, 200}));
  auto ckpt = load_safetensors(file("old.safetensors"));
  ASSERT_EQ(ckpt.tensors.size(), 2u);
  EXPECT_EQ(ckpt.tensors[0].first, "early");
  EXPECT_TRUE(at::equal(ckpt.tensors[0].second, at::tensor({-1, 7}, at::kShort)));
  EXPECT_EQ(ckpt.tensors[1].first, "late");
  EXPECT_TRUE(at::equal(ckpt.tensors[1].second, at::tensor({9, 200}, at::kByte)));
}

TEST_F(SafetensorsTest, TruncatedFileNamesPathAndSaysTruncated) {
  save_safetensors(file("full.safetensors"),
      {{"w", at::randn({4, 4})}, {"b", at::zeros({4}, at::kLong)}}, {{"step", "7"}});
  const std::string full = dtp::test::read_bytes(file("full.safetensors"));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(full[i]);
  const size_t dataStart = 8 + n;
  ASSERT_EQ(full.size(), dataStart + 4 * 4 * 4 + 4 * 8);
  const std::string path = file("cut.safetensors");
  for (size_t cut : {size_t{0}, size_t{3}, size_t{7}, size_t{8}, size_t{20}, dataStart - 1, dataStart,
           dataStart + 30, full.size() - 1}) {
    dtp::test::write_bytes(path, full.substr(0, cut));
    const std::string err = dtp::test::any_error_of([&] { load_safetensors(path); });
    EXPECT_NE(err.find(path), std::string::npos) << "cut at " << cut << ": " << err;
    EXPECT_NE(err.find("truncated"), std::string::npos) << "cut at " << cut << ": " << err;
    EXPECT_NE(err.find("re-save"), std::string::npos) << "cut at " << cut << ": " << err;
  }
  dtp::test::write_bytes(path, full.substr(0, 20));
  EXPECT_ERROR(load_safetensors(path), "truncated: header says " + std::to_string(n) + " bytes, file has 12");
  dtp::test::write_bytes(path, full.substr(0, dataStart + 30));
  EXPECT_ERROR(load_safetensors(path), "needs 96 data bytes (file size " + std::to_string(full.size()) +
      "), file has 30");
}

TEST_F(SafetensorsTest, CorruptHeaderIsRejectedWithPath) {
  std::string p = raw(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})", bytes({0, 0, 0, 0}));
  EXPECT_ERROR(load_safetensors(p), "load_safetensors: '" + p + "': header is not valid JSON");
  p = raw(R"([1,2])", "");
  EXPECT_ERROR(load_safetensors(p), "header is a JSON array, expected an object");
  p = raw(std::string(100, '[') + std::string(100, ']'), "");
  EXPECT_ERROR(load_safetensors(p), "nests deeper than 8 levels");
  dtp::test::write_bytes(p, lengthPrefix(~uint64_t{0}) + "{}");
  EXPECT_ERROR(load_safetensors(p), "truncated: header says 18446744073709551615 bytes, file has 2");
}

TEST_F(SafetensorsTest, UnknownDtypeListsSupportedOnes) {
  std::string p = raw(R"({"w":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})", bytes({1, 2}));
  EXPECT_ERROR(load_safetensors(p), "'" + p + "': unknown dtype for tensor 'w': got \"F8_E4M3\", expected one of "
      "F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL");
}

TEST_F(SafetensorsTest, OffsetsThatDisagreeWithShapeAreRejected) {
  std::string p = raw(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", bytes({0, 0, 0, 0}));
  EXPECT_ERROR(load_safetensors(p), "do not match dtype and shape for tensor 'w': got 4 bytes, expected 8 for F32[2]");
  p = raw(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}})", "");
  EXPECT_ERROR(load_safetensors(p), "expected more than 2^64");
}

TEST_F(SafetensorsTest, OverlappingGappedAndTrailingDataAreRejected) {
  std::string p = raw(R"({"a":{"dtype":"I32","shape":[2],"data_offsets":[0,8]},)"
                      R"("b":{"dtype":"I32","shape":[2],"data_offsets":[4,12]}})", std::string(12, '\0'));
  EXPECT_ERROR(load_safetensors(p), "overlapping data for tensor 'b': it starts at byte 4, expected 8");
  p = raw(R"({"a":{"dtype":"I32","shape":[2],"data_offsets":[0,8]},)"
          R"("b":{"dtype":"I32","shape":[2],"data_offsets":[12,20]}})", std::string(20, '\0'));
  EXPECT_ERROR(load_safetensors(p), "gap before data for tensor 'b': it starts at byte 12, expected 8");
  p = raw(R"({"a":{"dtype":"I32","shape":[1],"data_offsets":[4,8]}})", std::string(8, '\0'));
  EXPECT_ERROR(load_safetensors(p), "gap before data for tensor 'a': it starts at byte 4, expected 0");
  p = raw(R"({"a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}})", std::string(9, '\0'));
  EXPECT_ERROR(load_safetensors(p), "file has 5 bytes after the last tensor");
}

TEST_F(SafetensorsTest, MalformedEntriesAreRejected) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"a":{"dtype":"I8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"I8","shape":[1],"data_offsets":[1,2]}})",
       "duplicate key 'a' in the header"},
      {R"({"__metadata__":{"step":100},"a":{"dtype":"I8","shape":[2],"data_offsets":[0,2]}})",
       "non-string metadata for key 'step': got number 100, expected a string"},
      {R"({"__metadata__":["x"],"a":{"dtype":"I8","shape":[2],"data_offsets":[0,2]}})",
       "__metadata__ is a JSON array, expected an object of strings"},
      {R"({"a":{"dtype":"I8","shape":[-2],"data_offsets":[0,2]}})", "bad shape for tensor 'a': got [-2]"},
      {R"({"a":{"dtype":"I8","shape":2,"data_offsets":[0,2]}})", "bad shape for tensor 'a': got 2"},
      {R"({"a":{"dtype":"I8","shape":[2],"data_offsets":[2,0]}})", "bad data_offsets for tensor 'a': got [2,0]"},
      {R"({"a":{"dtype":"I8","shape":[2],"data_offsets":[0,1,2]}})", "bad data_offsets for tensor 'a'"},
      {R"({"a":{"dtype":"I8","shape":[2]}})", "no \"data_offsets\" for tensor 'a'"},
      {R"({"a":[1,2]})", "entry for tensor 'a' is a JSON array"},
      {R"({"a":{"dtype":8,"shape":[2],"data_offsets":[0,2]}})", "unknown dtype for tensor 'a': got 8"},
      {R"({"a":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", "BOOL tensor 'a' holds bytes other than 0 and 1"},
  };
  for (const auto& [json, expected] : cases) {
    std::string p = raw(json, bytes({1, 2}));
    const std::string err = dtp::test::any_error_of([&] { load_safetensors(p); });
    EXPECT_NE(err.find(expected), std::string::npos) << json << "\n" << err;
    EXPECT_NE(err.find(p), std::string::npos) << err;
  }
}

TEST_F(SafetensorsTest, MissingFileNamesPath) {
  const std::string p = file("nope.safetensors");
  EXPECT_ERROR(load_safetensors(p), "load_safetensors: '" + p + "': cannot open: No such file or directory");
  EXPECT_ERROR(load_safetensors(dir_.string()), "not a regular file");
}

// A file that fails its checks is closed again (the fuzzer once ran out of
// descriptors): 100 failed loads leave the count of open descriptors as it was.
TEST_F(SafetensorsTest, FailedLoadsCloseTheirFile) {
  const std::string p = file("corrupt.safetensors");
  dtp::test::write_bytes(p, std::string("\x10\0\0\0\0\0\0\0{not json}      ", 24));
  auto openFds = [] {
    int n = 0;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
    return n;
  };
  const int before = openFds();
  for (int i = 0; i < 100; ++i) EXPECT_ERROR(load_safetensors(p), "header is not valid JSON");
  EXPECT_EQ(openFds(), before);
}

TEST_F(SafetensorsTest, SaveRejectsBadEntriesBeforeWriting) {
  const std::string p = file("bad.safetensors");
  at::Tensor w = at::ones({2});
  EXPECT_ERROR(save_safetensors(p, {{"w", w}, {"b", w}, {"w", w}}),
      "duplicate name 'w' for '" + p + "': got it at entries 0 and 2");
  EXPECT_ERROR(save_safetensors(p, {{"w", w}, {"", w}}), "empty name for entry 1 of '" + p + "'");
  EXPECT_ERROR(save_safetensors(p, {{"__metadata__", w}}), "is reserved");
  EXPECT_ERROR(save_safetensors(p, {{"w", at::Tensor()}}), "undefined tensor for 'w' (entry 0) of '" + p + "'");
  EXPECT_ERROR(save_safetensors(p, {{"c", at::ones({2}, at::kComplexFloat)}}),
      "unsupported dtype for 'c' of '" + p + "': got ComplexFloat");
  EXPECT_TRUE(listing().empty());
}

TEST_F(SafetensorsTest, SaveIntoMissingDirectoryNamesPathAndErrno) {
  const std::string p = file("no/such/dir/x.safetensors");
  EXPECT_ERROR(save_safetensors(p, {{"w", at::ones({2})}}), "cannot create temporary file '" + p + ".tmp.");
  EXPECT_ERROR(save_safetensors(p, {{"w", at::ones({2})}}), "No such file or directory");
  EXPECT_TRUE(listing().empty());
}

TEST_F(SafetensorsTest, FailedSaveLeavesExistingFileByteForByte) {
  const std::string p = file("ckpt.safetensors");
  save_safetensors(p, {{"w", at::randn({8})}}, {{"step", "1"}});
  const std::string before = dtp::test::read_bytes(p);
  EXPECT_ERROR(save_safetensors(p, {{"w", at::randn({8})}, {"w2", at::Tensor()}}, {{"step", "2"}}),
      "undefined tensor for 'w2' (entry 1)");
  EXPECT_EQ(dtp::test::read_bytes(p), before);
  EXPECT_EQ(listing(), std::vector<std::string>{"ckpt.safetensors"});
  EXPECT_EQ(load_safetensors(p).metadata.at("step"), "1");
}

TEST_F(SafetensorsTest, SaveOntoAFolderIsRefusedBeforeWriting) {
  // A folder at the path is not a file dtp wrote: refused before any
  // temporary file exists (NOTE: [Nothing dtp did not write]).
  const std::string p = file("taken");
  fs::create_directories(p);
  dtp::test::write_bytes(p + "/keep", "x");
  EXPECT_ERROR(save_safetensors(p, {{"w", at::ones({1000})}}), "'" + p + "' exists and is not a file");
  EXPECT_EQ(listing(), std::vector<std::string>{"taken"});
  EXPECT_EQ(dtp::test::read_bytes(p + "/keep"), "x");
}

TEST_F(SafetensorsTest, SaveReplacesExistingFile) {
  const std::string p = file("ckpt.safetensors");
  save_safetensors(p, {{"w", at::zeros({3})}});
  save_safetensors(p, {{"v", at::ones({2}, at::kInt)}}, {{"step", "2"}});
  auto ckpt = load_safetensors(p);
  ASSERT_EQ(ckpt.tensors.size(), 1u);
  EXPECT_EQ(ckpt.tensors[0].first, "v");
  EXPECT_TRUE(at::equal(ckpt.tensors[0].second, at::ones({2}, at::kInt)));
  EXPECT_EQ(listing(), std::vector<std::string>{"ckpt.safetensors"});
}

}  // namespace

namespace {

// NOTE: [Tensor checksums]. A flipped byte anywhere in the file is an error
// (the header's JSON or structure, or a tensor's CRC-32) or harmless (JSON
// whitespace, the padding): it never loads as different numbers. Flips in
// tensor data name the tensor.
TEST_F(SafetensorsTest, EveryByteFlipIsCaughtOrHarmless) {
  const TensorMap tensors = {{"w", at::linspace(-1, 1, 24, at::kFloat).view({4, 6})},
                             {"step", at::tensor({int64_t{1200}})},
                             {"b", at::arange(5, at::kDouble)}};
  save_safetensors(file("good.safetensors"), tensors, {{"format", "pt"}});
  const std::string good = dtp::test::read_bytes(file("good.safetensors"));
  uint64_t header = 0;
  for (int b = 7; b >= 0; --b) header = (header << 8) | static_cast<unsigned char>(good[b]);
  const size_t data_start = 8 + header;
  std::mt19937 rng(7);
  int caught = 0, harmless = 0, data_flips = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::string bad = good;
    const size_t pos = rng() % bad.size();
    bad[pos] = static_cast<char>(bad[pos] ^ (1 + rng() % 255));
    dtp::test::write_bytes(file("bad.safetensors"), bad);
    try {
      auto got = load_safetensors(file("bad.safetensors"));
      ASSERT_EQ(got.tensors.size(), tensors.size()) << "flip at byte " << pos;
      for (size_t i = 0; i < tensors.size(); ++i) {
        EXPECT_EQ(got.tensors[i].first, tensors[i].first) << "flip at byte " << pos;
        EXPECT_TRUE(got.tensors[i].second.equal(tensors[i].second)) << "flip at byte " << pos << " loaded other numbers";
      }
      EXPECT_LT(pos, data_start) << "a flip in tensor data loaded";
      ++harmless;
    } catch (const c10::Error& e) {
      ++caught;
      if (pos >= data_start) {
        ++data_flips;
        EXPECT_NE(std::string(e.what()).find("fails its checksum"), std::string::npos) << e.what();
      }
    }
  }
  EXPECT_GT(data_flips, 100);
  EXPECT_EQ(caught + harmless, 300);
  // One named: the first byte of "b" (after w's 96 and step's 8 bytes).
  std::string bad = good;
  bad[data_start + 96 + 8] ^= 0x01;
  dtp::test::write_bytes(file("bad.safetensors"), bad);
  dtp::test::expect_error([&] { load_safetensors(file("bad.safetensors")); },
                          {"tensor 'b' fails its checksum", "load the previous checkpoint"});
  // Checksum entries stay internal; the user's metadata round-trips.
  EXPECT_EQ(load_safetensors(file("good.safetensors")).metadata,
            (std::map<std::string, std::string>{{"format", "pt"}}));
  dtp::test::expect_error([&] { save_safetensors(file("x.safetensors"), tensors, {{"dtp.crc32:w", "0"}}); },
                          {"reserved for dtp's tensor checksums"});
}

}  // namespace
