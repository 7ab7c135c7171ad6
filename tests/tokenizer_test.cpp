// Tokenizers: sentencepiece ids against spm_encode's, round trips, BOS, and
// the errors for files dtp cannot read. The fixture is
// tests/data/tokenizer/tiny.model (see the README beside it).
#include "dtp/text/tokenizer.h"
#include "files.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#ifndef DTP_TEST_DATA_DIR
#error "DTP_TEST_DATA_DIR must name tests/data (tests/CMakeLists.txt defines it)"
#endif

namespace dtp::models {
namespace {

using dtp::test::any_error_of;
using Ids = std::vector<int64_t>;

// Built without libsentencepiece-dev (CMake warns; a pip-wheel machine
// without apt): the tests that need the module are reported as skipped.
#ifdef DTP_WITH_SENTENCEPIECE
#define REQUIRE_SENTENCEPIECE() (void)0
#else
#define REQUIRE_SENTENCEPIECE() GTEST_SKIP() << "dtp was built without sentencepiece (libsentencepiece-dev)"
#endif

const std::string kTinyModel = std::string(DTP_TEST_DATA_DIR) + "/tokenizer/tiny.model";
const std::string kSupported =
    "supported: a Hugging Face tokenizer.json (Llama 2/3, Mistral, Qwen 2.5/3), a sentencepiece tokenizer.model "
    "(Llama 1/2, Mistral), or byte-level (the default)";

struct Golden {
  std::string text;
  Ids ids;
};

// Golden ids from the sentencepiece CLI (Debian 12's `sentencepiece` 0.1.97),
// one line per text, run in tests/data/tokenizer:
//   spm_encode --model=tiny.model --output_format=id
// The comment above each entry is the same with --output_format=piece.
const std::vector<Golden>& golden() {
  static const std::vector<Golden> g = {
      // ▁ H e ll o , ▁w or ld !
      {"Hello, world!", {329, 367, 330, 284, 335, 343, 266, 277, 312, 375}},
      // ▁The ▁t ens or ▁is ▁s p l it ▁a c ro s s ▁ 2 ▁ dev ic es .  (split_digits)
      {"The tensor is split across 2 devices.",
       {281, 259, 315, 277, 283, 263, 351, 340, 299, 262, 344, 292, 333, 333, 329, 359, 329, 328, 319, 274, 348}},
      // ▁h é ll o ▁w <0xC3> <0xB6> r ld  (é is in the training text, ö is not)
      {"h\xC3\xA9llo w\xC3\xB6rld", {302, 383, 284, 335, 266, 198, 185, 336, 312}},
      // ▁c a f é ▁ <0xF0> <0x9F> <0x99> <0x82> ▁d o n e  (U+1F642 by byte fallback)
      {"caf\xC3\xA9 \xF0\x9F\x99\x82 done", {280, 332, 346, 383, 329, 243, 162, 156, 133, 327, 335, 334, 330}},
      {"", {}},
      // ▁ ▁ ▁l ea d ing ▁s p a c es  (remove_extra_whitespaces=false keeps them)
      {"  leading spaces", {329, 329, 275, 273, 339, 290, 263, 351, 332, 344, 274}},
      // ▁t a b <0x09> a nd ▁ ▁d ou b le ▁ ▁s p a c es ▁
      {"tab\tand  double  spaces ",
       {259, 332, 349, 12, 332, 264, 329, 327, 304, 349, 300, 329, 263, 351, 332, 344, 274, 329}},
  };
  return g;
}

std::string concatTokens(const Tokenizer& tok, const Ids& ids) {
  std::string text;
  for (const int64_t id : ids) text += tok.decode_token(id);
  return text;
}

TEST(SentencePieceTokenizerTest, EncodeMatchesSpmEncode) {
  REQUIRE_SENTENCEPIECE();
  const SentencePieceTokenizer tok(kTinyModel);
  for (const auto& [text, ids] : golden()) {
    EXPECT_EQ(tok.encode(text, /*add_bos=*/false), ids) << "text '" << text << "'";
  }
}

TEST(SentencePieceTokenizerTest, DecodeInvertsEncode) {
  REQUIRE_SENTENCEPIECE();
  const SentencePieceTokenizer tok(kTinyModel);
  for (const auto& g : golden()) {
    EXPECT_EQ(tok.decode(tok.encode(g.text, /*add_bos=*/false)), g.text);
    EXPECT_EQ(tok.decode(g.ids), g.text);
  }
}

TEST(SentencePieceTokenizerTest, FollowsTheModelsSpecialIds) {
  REQUIRE_SENTENCEPIECE();
  const SentencePieceTokenizer tok(kTinyModel);
  EXPECT_EQ(tok.vocab_size(), 384);
  EXPECT_EQ(tok.bos_id(), std::optional<int64_t>(1));
  EXPECT_EQ(tok.eos_id(), std::optional<int64_t>(2));
  EXPECT_EQ(tok.name(), "sentencepiece " + kTinyModel);
}

// As Hugging Face's LlamaTokenizer: BOS first, no EOS; decode keeps both as
// their pieces, skip_special_tokens drops them.
TEST(SentencePieceTokenizerTest, AddBosPrependsBosAndDecodeKeepsItUnlessSkipped) {
  REQUIRE_SENTENCEPIECE();
  const SentencePieceTokenizer tok(kTinyModel);
  const Golden& hello = golden()[0];
  Ids with_bos = {1};
  with_bos.insert(with_bos.end(), hello.ids.begin(), hello.ids.end());
  EXPECT_EQ(tok.encode(hello.text, /*add_bos=*/true), with_bos);
  EXPECT_EQ(tok.encode("", /*add_bos=*/true), Ids{1});
  EXPECT_EQ(tok.decode(with_bos, /*skip_special_tokens=*/true), hello.text);
  EXPECT_EQ(tok.decode(with_bos), "<s>" + hello.text);
  with_bos.push_back(2);
  EXPECT_EQ(tok.decode(with_bos, /*skip_special_tokens=*/true), hello.text);
  EXPECT_EQ(tok.decode(with_bos), "<s>" + hello.text + "</s>");
  // Between pieces: each run of text decodes as sentencepiece decodes it.
  Ids twice = with_bos;
  twice.insert(twice.end(), hello.ids.begin(), hello.ids.end());
  EXPECT_EQ(tok.decode(twice), "<s>" + hello.text + "</s>" + hello.text);
}

// Tokens streamed one at a time spell the text, with the dummy prefix's
// space in front, and multi-byte characters reassembled from byte tokens.
TEST(SentencePieceTokenizerTest, DecodeTokenStreamsTheText) {
  REQUIRE_SENTENCEPIECE();
  const SentencePieceTokenizer tok(kTinyModel);
  for (const auto& g : golden()) {
    if (g.text.empty()) continue;
    EXPECT_EQ(concatTokens(tok, g.ids), " " + g.text);
  }
  EXPECT_EQ(tok.decode_token(1), "<s>");
  EXPECT_EQ(tok.decode_token(2, /*skip_special_tokens=*/true), "");
  EXPECT_EQ(tok.decode_token(243), "\xF0");  // <0xF0>
}

TEST(SentencePieceTokenizerTest, DecodeRejectsIdsOutsideTheVocabulary) {
  REQUIRE_SENTENCEPIECE();
  const SentencePieceTokenizer tok(kTinyModel);
  for (const std::string& msg : {any_error_of([&] { tok.decode({5, 384}); }),
                                 any_error_of([&] { tok.decode_token(-1); })}) {
    EXPECT_NE(msg.find("token id out of range for tokenizer sentencepiece " + kTinyModel), std::string::npos) << msg;
    EXPECT_NE(msg.find("expected 0 <= id < 384"), std::string::npos) << msg;
  }
}

// Ranks run as threads (dist.h): each may encode at once.
TEST(SentencePieceTokenizerTest, EncodesFromManyThreadsAtOnce) {
  REQUIRE_SENTENCEPIECE();
  const SentencePieceTokenizer tok(kTinyModel);
  std::vector<Ids> got(4);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < got.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) got[t] = tok.encode(golden()[t].text, /*add_bos=*/false);
    });
  }
  for (auto& thread : threads) thread.join();
  for (size_t t = 0; t < got.size(); ++t) EXPECT_EQ(got[t], golden()[t].ids) << "thread " << t;
}

TEST(ByteTokenizerTest, RoundTripsAnyBytes) {
  const ByteTokenizer tok;
  const std::string text = std::string("A\0b", 3) + "h\xC3\xA9llo \xF0\x9F\x99\x82 \xFF";
  const Ids ids = tok.encode(text, /*add_bos=*/true);  // no BOS to add
  ASSERT_EQ(ids.size(), text.size());
  EXPECT_EQ((Ids{ids[0], ids[1], ids[2], ids.back()}), (Ids{65, 0, 98, 255}));
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_EQ(concatTokens(tok, ids), text);
  EXPECT_EQ(tok.vocab_size(), 256);
  EXPECT_EQ(tok.bos_id(), std::nullopt);
  EXPECT_EQ(tok.eos_id(), std::nullopt);
  const std::string msg = any_error_of([&] { tok.decode({256}); });
  EXPECT_NE(msg.find("got 256, expected 0 <= id < 256"), std::string::npos) << msg;
}

class LoadTokenizerTest : public dtp::test::TempDirTest {};

TEST_F(LoadTokenizerTest, EmptyOrByteGivesByteTokenizer) {
  EXPECT_EQ(load_tokenizer("")->name(), "byte");
  EXPECT_EQ(load_tokenizer("byte")->name(), "byte");
}

TEST_F(LoadTokenizerTest, ReadsAModelFileOrAFolderHoldingOne) {
  REQUIRE_SENTENCEPIECE();
  std::filesystem::copy_file(kTinyModel, file("tokenizer.model"));  // a folder without tokenizer.json
  for (const std::string& path : {kTinyModel, dir_.string()}) {
    const auto tok = load_tokenizer(path);
    EXPECT_EQ(tok->encode(golden()[0].text, /*add_bos=*/false), golden()[0].ids) << path;
  }
  EXPECT_EQ(load_tokenizer(dir_.string())->name(), "sentencepiece " + file("tokenizer.model"));
}

// A folder's tokenizer.json is read by HfTokenizer (tokenizer_json_test.cpp),
// which names the file when it cannot.
TEST_F(LoadTokenizerTest, IncompleteTokenizerJsonIsAnErrorNamingIt) {
  dtp::test::write_bytes(file("tokenizer.json"), R"({"version": "1.0", "model": {"type": "BPE"}})");
  for (const std::string& path : {dir_.string(), file("tokenizer.json")}) {
    const std::string msg = any_error_of([&] { load_tokenizer(path); });
    EXPECT_NE(msg.find("missing field in '" + file("tokenizer.json") + "': got a model without \"vocab\""),
              std::string::npos)
        << msg;
  }
}

TEST_F(LoadTokenizerTest, TiktokenModelIsAnError) {
  dtp::test::write_bytes(file("tokenizer.model"), "IQ== 0\nIg== 1\nIw== 2\n");  // Llama 3's original/ format
  const std::string msg = any_error_of([&] { load_tokenizer(dir_.string()); });
  EXPECT_NE(msg.find("unsupported tokenizer for '" + file("tokenizer.model") + "': got a tiktoken BPE file"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find(kSupported), std::string::npos) << msg;
}

TEST_F(LoadTokenizerTest, MissingPathOrEmptyFolderIsAnError) {
  std::string msg = any_error_of([&] { load_tokenizer(file("nowhere/tokenizer.model")); });
  EXPECT_NE(msg.find("no tokenizer for '" + file("nowhere/tokenizer.model") + "': got a missing path"),
            std::string::npos)
      << msg;
  msg = any_error_of([&] { load_tokenizer(dir_.string()); });
  EXPECT_NE(msg.find("no tokenizer in folder '" + dir_.string() + "': got neither tokenizer.json nor tokenizer.model"),
            std::string::npos)
      << msg;
}

TEST_F(LoadTokenizerTest, TruncatedOrCorruptModelIsAnErrorNamingTheFile) {
  REQUIRE_SENTENCEPIECE();
  const std::string model = dtp::test::read_bytes(kTinyModel);
  std::string corrupt = model;
  corrupt[0] = '\x07';  // field 0, wire type 7: no such thing
  for (const std::string& content : {std::string(), model.substr(0, 10), model.substr(0, model.size() / 2),
                                     std::string("not a model\n"), corrupt}) {
    dtp::test::write_bytes(file("tokenizer.model"), content);
    const std::string msg = any_error_of([&] { load_tokenizer(file("tokenizer.model")); });
    EXPECT_NE(msg.find("cannot load the model for '" + file("tokenizer.model") + "'"), std::string::npos)
        << content.size() << " bytes: " << msg;
    EXPECT_NE(msg.find("(" + std::to_string(content.size()) + " bytes)"), std::string::npos) << msg;
  }
}

// Sentencepiece writes to std::cerr here ("1/1 samples did not pass the
// test."), which crashes if its module is loaded with RTLD_DEEPBIND instead
// of into a namespace of its own. See NOTE: [Sentencepiece in its own namespace].
TEST_F(LoadTokenizerTest, ModelFailingItsSelfTestIsAnErrorNotACrash) {
  REQUIRE_SENTENCEPIECE();
  // ModelProto.self_test_data (field 4) = {samples: [{input: "a", expected: "zzz"}]}.
  const std::string sample = std::string("\x0a\x01" "a" "\x12\x03" "zzz", 8);
  const std::string self_test = "\x0a" + std::string(1, static_cast<char>(sample.size())) + sample;
  dtp::test::write_bytes(file("tokenizer.model"), dtp::test::read_bytes(kTinyModel) + "\x22" +
                                                      std::string(1, static_cast<char>(self_test.size())) + self_test);
  const std::string msg = any_error_of([&] { load_tokenizer(dir_.string()); });
  EXPECT_NE(msg.find("cannot load the model for '" + file("tokenizer.model") + "': got \"Self-test failures."),
            std::string::npos)
      << msg;
}

}  // namespace
}  // namespace dtp::models
