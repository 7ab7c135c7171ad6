// Hugging Face tokenizer.json (HfTokenizer), chat templates and end tokens,
// on small files written here. Each expectation is worked out by hand from
// Hugging Face's `tokenizers` semantics; tests/tokenizers/run_reference.sh
// compares real files against Hugging Face's own implementations.
#include "dtp/text/chat.h"
#include "dtp/text/hf_tokenizer.h"
#include "dtp/text/tokenizer.h"
#include "files.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <ctime>
#include <fstream>
#include <sstream>
#include <thread>

namespace dtp::models {
namespace {

using dtp::test::any_error_of;
using nlohmann::json;
using Ids = std::vector<int64_t>;

#ifdef DTP_WITH_PCRE2
#define REQUIRE_PCRE2() (void)0
#else
#define REQUIRE_PCRE2() GTEST_SKIP() << "dtp was built without PCRE2 (libpcre2-dev)"
#endif

const char* const kSplitRegex = R"('s|'t| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

json addedToken(int id, const std::string& content, bool special, bool lstrip = false, bool rstrip = false) {
  return {{"id", id},         {"content", content}, {"single_word", false}, {"lstrip", lstrip},
          {"rstrip", rstrip}, {"normalized", false}, {"special", special}};
}

// Byte-level BPE in Llama 3's shape. "Ġ" (U+0120) stands for a space byte;
// "ï¿½" are the bytes EF BF BD of U+FFFD.
json byteLevel(bool array_merges = false, bool ignore_merges = false) {
  json vocab = {{"h", 0},   {"e", 1},  {"l", 2},   {"o", 3},    {"w", 4},     {"r", 5},      {"d", 6},
                {"Ġ", 7},   {"he", 8}, {"ll", 9},  {"hell", 10}, {"hello", 11}, {"Ġw", 12},   {"or", 13},
                {"Ġwor", 14}, {"ld", 15}, {"Ġworld", 16}, {"!", 17}, {"hlo", 18}, {"ï", 19}, {"¿", 20}, {"½", 21}};
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {"Ġ", "w"}, {"o", "r"}, {"Ġw", "or"}, {"l", "d"},
      {"Ġwor", "ld"}};
  json merges = json::array();
  for (const auto& [a, b] : pairs) merges.push_back(array_merges ? json::array({a, b}) : json(a + " " + b));
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens",
           {addedToken(22, "<|bos|>", true), addedToken(23, "<|im_start|>", true), addedToken(24, "<|im", false),
            addedToken(25, "<|eot|>", true, /*lstrip=*/true, /*rstrip=*/true)}},
          {"normalizer", nullptr},
          {"pre_tokenizer",
           {{"type", "Sequence"},
            {"pretokenizers",
             {{{"type", "Split"}, {"pattern", {{"Regex", kSplitRegex}}}, {"behavior", "Isolated"}, {"invert", false}},
              {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}}}}},
          {"post_processor",
           {{"type", "TemplateProcessing"},
            {"single", {{{"SpecialToken", {{"id", "<|bos|>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
            {"pair", json::array()},
            {"special_tokens", {{"<|bos|>", {{"id", "<|bos|>"}, {"ids", {22}}, {"tokens", {"<|bos|>"}}}}}}}},
          {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false},
            {"ignore_merges", ignore_merges}, {"vocab", vocab}, {"merges", merges}}}};
}

// Sentencepiece-style BPE in Llama 2's shape: <0xNN> pieces are ids 3..258.
json sentencePieceStyle(bool byte_fallback = true) {
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    vocab[name] = 3 + b;
  }
  vocab["▁"] = 259;
  vocab["H"] = 260;
  vocab["i"] = 261;
  vocab["▁H"] = 262;
  vocab["▁Hi"] = 263;
  return {{"version", "1.0"},
          {"added_tokens", {addedToken(0, "<unk>", true), addedToken(1, "<s>", true), addedToken(2, "</s>", true)}},
          {"normalizer",
           {{"type", "Sequence"},
            {"normalizers",
             {{{"type", "Prepend"}, {"prepend", "▁"}},
              {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "▁"}}}}}},
          {"pre_tokenizer", nullptr},
          {"post_processor",
           {{"type", "TemplateProcessing"},
            {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
            {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
          {"decoder",
           {{"type", "Sequence"},
            {"decoders",
             {{{"type", "Replace"}, {"pattern", {{"String", "▁"}}}, {"content", " "}},
              {{"type", "ByteFallback"}},
              {{"type", "Fuse"}},
              {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", "<unk>"}, {"fuse_unk", true},
            {"byte_fallback", byte_fallback}, {"vocab", vocab}, {"merges", {"▁ H", "▁H i"}}}}};
}

class HfTokenizerTest : public dtp::test::TempDirTest {
 protected:
  std::unique_ptr<HfTokenizer> load(const json& j, const std::string& name = "tokenizer.json") {
    dtp::test::write_bytes(file(name), j.dump());
    return std::make_unique<HfTokenizer>(file(name));
  }
  // The error of loading `j`, which must name the file.
  std::string loadError(const json& j) {
    dtp::test::write_bytes(file("tokenizer.json"), j.dump());
    const std::string msg = any_error_of([&] { HfTokenizer tok(file("tokenizer.json")); });
    EXPECT_NE(msg.find(file("tokenizer.json")), std::string::npos) << msg;
    return msg;
  }
};

TEST_F(HfTokenizerTest, ByteLevelBpeMergesByRankThenLeftmost) {
  REQUIRE_PCRE2();
  const auto tok = load(byteLevel());
  // "hello" "Ġworld" "!": the split regex isolates them, the merges build each.
  EXPECT_EQ(tok->encode("hello world!", /*add_bos=*/false), (Ids{11, 16, 17}));
  EXPECT_EQ(tok->encode("hel", false), (Ids{8, 2}));      // h+e (rank 0) first, then no (he, l) merge
  EXPECT_EQ(tok->encode("lll", false), (Ids{9, 2}));      // two equal (l, l): the leftmost merges
  EXPECT_EQ(tok->encode("hlo", false), (Ids{0, 2, 3}));   // in the vocabulary, but no merge reaches it
  EXPECT_EQ(tok->encode("", false), Ids{});
  EXPECT_EQ(tok->vocab_size(), 26);
  EXPECT_EQ(tok->name(), "tokenizer.json " + file("tokenizer.json"));
}

TEST_F(HfTokenizerTest, MergesAsStringsOrPairsAreTheSame) {
  REQUIRE_PCRE2();
  const auto strings = load(byteLevel(/*array_merges=*/false), "a.json");
  const auto pairs = load(byteLevel(/*array_merges=*/true), "b.json");
  for (const std::string text : {"hello world!", "lll hel", "world hello"}) {
    EXPECT_EQ(strings->encode(text, true), pairs->encode(text, true)) << text;
  }
}

TEST_F(HfTokenizerTest, IgnoreMergesTakesAWholeWordFromTheVocabulary) {
  REQUIRE_PCRE2();
  const auto tok = load(byteLevel(false, /*ignore_merges=*/true));
  EXPECT_EQ(tok->encode("hlo", false), Ids{18});  // Llama 3 sets ignore_merges
  EXPECT_EQ(tok->encode("hello", false), Ids{11});
}

TEST_F(HfTokenizerTest, AddedTokensMatchFirstLongestAndAsOneId) {
  REQUIRE_PCRE2();
  const auto tok = load(byteLevel());
  EXPECT_EQ(tok->encode("<|im_start|>hello", false), (Ids{23, 11}));  // the longest of <|im and <|im_start|>
  EXPECT_EQ(tok->encode("<|imhello", false), (Ids{24, 11}));           // a non-special added token, too
  // <|eot|> strips the white space on both sides (lstrip, rstrip).
  EXPECT_EQ(tok->encode("hello  <|eot|>  world", false), (Ids{11, 25, 4, 13, 15}));
  EXPECT_EQ(tok->token_to_id("<|im_start|>"), 23);
  EXPECT_EQ(tok->token_to_id("hello"), 11);
  EXPECT_EQ(tok->token_to_id("nope"), std::nullopt);
  EXPECT_TRUE(tok->is_special(23));
  EXPECT_FALSE(tok->is_special(24));
  EXPECT_FALSE(tok->is_special(11));
}

TEST_F(HfTokenizerTest, PostProcessorAddsBosAndTokenizerConfigNamesEos) {
  REQUIRE_PCRE2();
  auto tok = load(byteLevel());
  EXPECT_EQ(tok->encode("hello", /*add_bos=*/true), (Ids{22, 11}));
  EXPECT_EQ(tok->bos_id(), 22);  // the post-processor's
  EXPECT_EQ(tok->eos_id(), std::nullopt);
  dtp::test::write_bytes(file("tokenizer_config.json"),
                         R"({"bos_token": {"content": "<|bos|>"}, "eos_token": "<|eot|>"})");
  tok = load(byteLevel());
  EXPECT_EQ(tok->bos_id(), 22);
  EXPECT_EQ(tok->eos_id(), 25);
  dtp::test::write_bytes(file("tokenizer_config.json"), R"({"bos_token": null, "eos_token": "<|nope|>"})");
  const std::string msg = any_error_of([&] { load(byteLevel()); });
  EXPECT_NE(msg.find("unknown eos_token in '" + file("tokenizer_config.json") + "': got '<|nope|>'"),
            std::string::npos)
      << msg;
}

// As Hugging Face's decode(ids, skip_special_tokens=False by default).
TEST_F(HfTokenizerTest, DecodeKeepsSpecialTokensUnlessSkippedAndStreamsBytes) {
  REQUIRE_PCRE2();
  const auto tok = load(byteLevel());
  EXPECT_EQ(tok->decode({22, 11, 16, 17, 23}), "<|bos|>hello world!<|im_start|>");
  EXPECT_EQ(tok->decode({22, 11, 16, 17, 23}, /*skip_special_tokens=*/true), "hello world!");
  EXPECT_EQ(tok->decode({24, 11}, /*skip_special_tokens=*/true), "<|imhello");  // not special: kept
  EXPECT_EQ(tok->decode_token(16), " world");
  EXPECT_EQ(tok->decode_token(22), "<|bos|>");
  EXPECT_EQ(tok->decode_token(22, /*skip_special_tokens=*/true), "");
  EXPECT_EQ(tok->decode({19}), "\xEF\xBF\xBD");  // "ï" stands for the byte EF: alone, not UTF-8
  EXPECT_EQ(tok->decode_token(19), "\xEF");        // streamed: the byte itself
}

TEST_F(HfTokenizerTest, InvalidUtf8BecomesReplacementCharacters) {
  REQUIRE_PCRE2();
  const auto tok = load(byteLevel());
  const Ids fffd = {19, 20, 21};  // EF BF BD
  EXPECT_EQ(tok->encode("\xFF", false), fffd);
  EXPECT_EQ(tok->encode("\xE2\x82", false), fffd);  // one maximal subpart: one U+FFFD
  EXPECT_EQ(tok->encode("\xFF\xFE", false), (Ids{19, 20, 21, 19, 20, 21}));
  EXPECT_EQ(tok->encode("\xED\xA0\x80", false).size(), 9u);  // a surrogate: three subparts
  EXPECT_EQ(tok->decode(fffd), "\xEF\xBF\xBD");
}

TEST_F(HfTokenizerTest, OutOfRangeIdIsAnError) {
  REQUIRE_PCRE2();
  const auto tok = load(byteLevel());
  for (const int64_t id : {int64_t{26}, int64_t{-1}}) {
    const std::string msg = any_error_of([&] { tok->decode({id}); });
    EXPECT_NE(msg.find("token id out of range for tokenizer.json " + file("tokenizer.json") + ": got " +
                       std::to_string(id) + ", expected 0 <= id < 26"),
              std::string::npos)
        << msg;
  }
}

TEST_F(HfTokenizerTest, EncodesTheSameOnSeveralThreads) {
  REQUIRE_PCRE2();
  const auto tok = load(byteLevel());
  const Ids expected = tok->encode("hello world! lll hel", true);
  std::vector<std::thread> threads;
  std::vector<int> same(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) same[t] += tok->encode("hello world! lll hel", true) == expected;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(same, std::vector<int>(4, 200));
}

TEST_F(HfTokenizerTest, SentencePieceStyleBpeWithByteFallback) {
  const auto tok = load(sentencePieceStyle());
  EXPECT_EQ(tok->encode("Hi", /*add_bos=*/true), (Ids{1, 263}));
  EXPECT_EQ(tok->encode("Hi Hi", false), (Ids{263, 263}));
  EXPECT_EQ(tok->encode("Hi\xC3\xA9", false), (Ids{263, 3 + 0xC3, 3 + 0xA9}));  // é by its bytes
  // The normalizer runs on each piece between added tokens: both get "▁".
  EXPECT_EQ(tok->encode("Hi<s>Hi", false), (Ids{263, 1, 263}));
  EXPECT_EQ(tok->decode({1, 263, 3 + 0xC3, 3 + 0xA9, 263}, /*skip_special_tokens=*/true),
            "Hi\xC3\xA9 Hi");  // Strip drops the first space
  // Kept, <s> goes through the decoders with the rest, as in Hugging Face's:
  // Strip then sees "<s> Hi...", which starts with no space.
  EXPECT_EQ(tok->decode({1, 263, 3 + 0xC3, 3 + 0xA9, 263}), "<s> Hi\xC3\xA9 Hi");
  EXPECT_EQ(tok->decode({3 + 0xC3, 3 + 0xC3}), "\xEF\xBF\xBD\xEF\xBF\xBD");   // not UTF-8: U+FFFD per byte
  EXPECT_EQ(tok->decode_token(263), " Hi");
  EXPECT_EQ(tok->decode_token(3 + 0xC3), "\xC3");
  EXPECT_EQ(tok->decode_token(1), "<s>");
  EXPECT_EQ(tok->decode_token(1, /*skip_special_tokens=*/true), "");
  EXPECT_EQ(tok->vocab_size(), 264);
}

TEST_F(HfTokenizerTest, UnknownCharactersFuseIntoOneUnk) {
  const auto tok = load(sentencePieceStyle(/*byte_fallback=*/false));
  EXPECT_EQ(tok->encode("\xC3\xA9\xC3\xA9", false), (Ids{259, 0}));  // "▁" then one fused <unk>
}

TEST_F(HfTokenizerTest, MetaspacePrependSchemeFirstSkipsPiecesAfterAddedTokens) {
  json j = sentencePieceStyle();
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", "first"}, {"split", false}};
  EXPECT_EQ(load(j, "first.json")->encode("Hi<s>Hi", false), (Ids{263, 1, 260, 261}));
  j["pre_tokenizer"]["prepend_scheme"] = "always";
  EXPECT_EQ(load(j, "always.json")->encode("Hi<s>Hi", false), (Ids{263, 1, 263}));
  j["pre_tokenizer"]["prepend_scheme"] = "never";
  EXPECT_EQ(load(j, "never.json")->encode("Hi Hi", false), (Ids{260, 261, 263}));
}

// --- bad input ---

TEST_F(HfTokenizerTest, TruncatedOrCorruptFileIsAnErrorNamingIt) {
  const std::string whole = sentencePieceStyle().dump();
  for (const std::string& content : {whole.substr(0, whole.size() / 2), std::string(), std::string("not json"),
                                     std::string("[1, 2]")}) {
    dtp::test::write_bytes(file("tokenizer.json"), content);
    const std::string msg = any_error_of([&] { HfTokenizer tok(file("tokenizer.json")); });
    EXPECT_NE(msg.find(file("tokenizer.json")), std::string::npos) << msg;
    EXPECT_TRUE(msg.find("truncated or corrupt") != std::string::npos || msg.find("expected an object") != std::string::npos)
        << msg;
  }
  const std::string msg = any_error_of([&] { HfTokenizer tok(file("missing.json")); });
  EXPECT_NE(msg.find("no tokenizer.json at '" + file("missing.json") + "': got a missing path"), std::string::npos)
      << msg;
}

TEST_F(HfTokenizerTest, UnsupportedModelTypesAreErrorsNamingThem) {
  for (const std::string type : {"Unigram", "WordPiece", "WordLevel"}) {
    json j = sentencePieceStyle();
    j["model"] = {{"type", type}, {"vocab", json::array()}};
    const std::string msg = loadError(j);
    EXPECT_NE(msg.find("unsupported model in '" + file("tokenizer.json") + "': got \"" + type +
                       "\", expected \"BPE\""),
              std::string::npos)
        << msg;
  }
}

TEST_F(HfTokenizerTest, UnsupportedStagesAreErrorsNamingThem) {
  const struct {
    const char* key;
    json value;
    const char* expected;
  } cases[] = {
      {"pre_tokenizer", {{"type", "BertPreTokenizer"}}, "unsupported pre_tokenizer in '%': got \"BertPreTokenizer\", "
                                                         "expected one of Sequence, Split, ByteLevel, Metaspace"},
      {"pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", {{{"type", "Whitespace"}}}}},
       "unsupported pre_tokenizer in '%': got \"Whitespace\""},
      {"normalizer", {{"type", "Lowercase"}}, "unsupported normalizer in '%': got \"Lowercase\", expected one of "
                                              "Sequence, NFC, NFD, NFKC, NFKD, Prepend, Replace"},
      {"decoder", {{"type", "WordPiece"}}, "unsupported decoder in '%': got \"WordPiece\""},
      {"post_processor", {{"type", "RobertaProcessing"}}, "unsupported post_processor in '%': got \"RobertaProcessing\", "
                                                          "expected one of Sequence, TemplateProcessing, ByteLevel"},
      {"truncation", {{"max_length", 8}}, "unsupported truncation in '%'"},
  };
  for (const auto& c : cases) {
    json j = sentencePieceStyle();
    j[c.key] = c.value;
    std::string expected = c.expected;
    expected.replace(expected.find('%'), 1, file("tokenizer.json"));
    const std::string msg = loadError(j);
    EXPECT_NE(msg.find(expected), std::string::npos) << msg;
  }
}

TEST_F(HfTokenizerTest, BadMergesAndRegexesAreErrorsNamingTheFile) {
  json j = sentencePieceStyle();
  j["model"]["merges"] = {"▁ Q"};
  std::string msg = loadError(j);
  EXPECT_NE(msg.find("bad merge 0 in '" + file("tokenizer.json") + "': got the token 'Q', which the vocabulary lacks"),
            std::string::npos)
      << msg;
  j["model"]["merges"] = {"▁ H i"};
  msg = loadError(j);
  EXPECT_NE(msg.find("expected two tokens separated by one space"), std::string::npos) << msg;
#ifdef DTP_WITH_PCRE2
  j = sentencePieceStyle();
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  msg = loadError(j);
  EXPECT_NE(msg.find("bad regex in '" + file("tokenizer.json") + "': got /(unclosed/"), std::string::npos) << msg;
#endif
}

// --- load_tokenizer and the model's vocabulary ---

TEST_F(HfTokenizerTest, LoadTokenizerPrefersTokenizerJsonInAFolder) {
  dtp::test::write_bytes(file("tokenizer.json"), sentencePieceStyle().dump());
  dtp::test::write_bytes(file("tokenizer.model"), "not read: the folder's tokenizer.json wins");
  EXPECT_EQ(load_tokenizer(dir_.string())->name(), "tokenizer.json " + file("tokenizer.json"));
  EXPECT_EQ(load_tokenizer(file("tokenizer.json"))->encode("Hi", true), (Ids{1, 263}));
  dtp::test::write_bytes(file("other-name"), sentencePieceStyle().dump());  // JSON by content
  EXPECT_EQ(load_tokenizer(file("other-name"))->name(), "tokenizer.json " + file("other-name"));
}

TEST_F(HfTokenizerTest, TokenizerLargerThanTheModelVocabularyIsAnErrorNamingBoth) {
  const auto tok = load(sentencePieceStyle());
  check_tokenizer_fits_model(*tok, 264, "model.json");
  check_tokenizer_fits_model(*tok, 300, "model.json");  // padded rows, as Qwen's 151936
  const std::string msg = any_error_of([&] { check_tokenizer_fits_model(*tok, 200, "hf/config.json"); });
  EXPECT_NE(msg.find("vocabulary mismatch between the tokenizer (tokenizer.json " + file("tokenizer.json") +
                     ") and the model (hf/config.json): got token ids up to 263, expected ids below the model's "
                     "vocab_size 200"),
            std::string::npos)
      << msg;
}

// --- chat templates ---

const char* const kLlama3Template =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

TEST(ChatTemplateTest, Llama3HeaderFormat) {
  const auto t = ChatTemplate::recognise(kLlama3Template, "<|begin_of_text|>", "<|eot_id|>", "cfg");
  EXPECT_EQ(t.family(), ChatTemplate::Family::kLlama3);
  EXPECT_EQ(t.format("Be brief.", "  Hi \n"),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(t.end_of_turn(), "<|eot_id|>");
}

TEST(ChatTemplateTest, ChatMlWithTheTemplatesDefaultSystemPrompt) {
  // Qwen 2.5's branches: a system message, else its default.
  const std::string qwen25 =
      "{%- if messages[0]['role'] == 'system' %}\n        {{- '<|im_start|>system\\n' + messages[0]['content'] + "
      "'<|im_end|>\\n' }}\n    {%- else %}\n        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
      "You are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}{%- for message in messages %}...<|im_start|>";
  const auto t = ChatTemplate::recognise(qwen25, "", "<|im_end|>", "cfg");
  EXPECT_EQ(t.family(), ChatTemplate::Family::kChatML);
  EXPECT_EQ(t.format(std::nullopt, "Hi"),
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(t.format("S", "Hi"), "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(t.format("S", "Hi", /*enable_thinking=*/false), t.format("S", "Hi"));  // Qwen 2.5 does not think
}

TEST(ChatTemplateTest, Qwen3EmptyThinkBlockOnlyWhenThinkingIsOff) {
  const std::string qwen3 =
      "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
      "{%- endif %}...{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n    {%- if "
      "enable_thinking is defined and enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
      "    {%- endif %}\n{%- endif %}";
  const auto t = ChatTemplate::recognise(qwen3, "", "<|im_end|>", "cfg");
  EXPECT_EQ(t.format(std::nullopt, "Hi"), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(t.format(std::nullopt, "Hi", /*enable_thinking=*/false),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
}

TEST(ChatTemplateTest, MistralInstWithAndWithoutSystem) {
  const auto v01 = ChatTemplate::recognise(
      "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + "
      "message['content'] + ' [/INST]' }}{% endif %}{% endfor %}",
      "<s>", "</s>", "v01");
  EXPECT_EQ(v01.format(std::nullopt, "Hi"), "<s>[INST] Hi [/INST]");
  EXPECT_EQ(v01.end_of_turn(), "</s>");
  const std::string msg = any_error_of([&] { v01.format("S", "Hi"); });
  EXPECT_NE(msg.find("no system prompt in the Mistral template of 'v01'"), std::string::npos) << msg;
  const auto v03 = ChatTemplate::recognise(
      "{{- bos_token }}{%- if loop.last and system_message is defined %}{{- '[INST] ' + system_message + '\\n\\n' + "
      "message['content'] + '[/INST]' }}{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}",
      "<s>", "</s>", "v03");
  EXPECT_EQ(v03.format("S", "Hi"), "<s>[INST] S\n\nHi[/INST]");
}

TEST(ChatTemplateTest, OtherTemplatesAreRefusedByName) {
  const struct {
    std::string text;
    const char* expected;
  } cases[] = {
      {"{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n{{ message['content'] }}"
       "<end_of_turn>\n{% endfor %}",
       "unsupported chat template in 'gemma/tokenizer_config.json': got a template without the markers of a known "
       "family (it begins \"{{ bos_token }}"},
      {std::string(kLlama3Template) + "Cutting Knowledge Date: December 2023",
       "got a dated Llama 3 template without the literal \"Cutting Knowledge Date: ...\\n\""},
      {"[INST] <<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n[/INST]", "got an [INST] <<SYS>> template other than Llama 2"},
  };
  for (const auto& c : cases) {
    const std::string msg =
        any_error_of([&] { ChatTemplate::recognise(c.text, "<s>", "</s>", "gemma/tokenizer_config.json"); });
    EXPECT_NE(msg.find(c.expected), std::string::npos) << msg;
    EXPECT_NE(msg.find("Llama 3's header format"), std::string::npos) << msg;
  }
}

// The conversations every family accepts: [system] user (assistant user)*;
// the renderings themselves are compared with Hugging Face's in
// tests/tokenizers/ (chat_cases.json's "messages").
TEST(ChatTemplateTest, BadRoleOrderIsAnErrorNamingWhatTheTemplateAccepts) {
  const auto t = ChatTemplate::recognise(kLlama3Template, "<|begin_of_text|>", "<|eot_id|>", "cfg");
  const std::vector<std::vector<ChatMessage>> bad = {
      {},
      {{"user", "a"}, {"user", "b"}},
      {{"user", "a"}, {"assistant", "b"}},
      {{"user", "a"}, {"system", "b"}, {"user", "c"}},
      {{"assistant", "a"}, {"user", "b"}},
      {{"user", "a"}, {"tool", "b"}, {"user", "c"}},
  };
  for (const auto& messages : bad) {
    const std::string msg = any_error_of([&] { t.format(messages); });
    EXPECT_NE(msg.find("bad role order for the Llama 3 chat template of 'cfg': got ["), std::string::npos) << msg;
    EXPECT_NE(msg.find("expected an optional system message first, then user and assistant turns alternating, "
                       "starting and ending with user"),
              std::string::npos)
        << msg;
  }
  EXPECT_NE(any_error_of([&] { t.format({{"user", "a"}, {"user", "b"}}); }).find("got [user, user]"),
            std::string::npos);
  EXPECT_EQ(t.format({{"user", "a"}, {"assistant", " b "}, {"user", "c"}}),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\na<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nb<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nc<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
}

// The real templates (tests/tokenizers/templates/, as Meta publishes them in
// the models' tokenizer_config.json).
std::string realTemplate(const std::string& name) {
  const std::string path = std::string(DTP_CHAT_TEMPLATES_DIR) + "/" + name;
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

std::string replaced(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << "no '" << from << "' in the template";
  return at == std::string::npos ? text : text.replace(at, from.size(), to);
}

std::string todayIn(const char* format) {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char buf[64];
  return std::string(buf, std::strftime(buf, sizeof buf, format, &local));  // the C locale: English months
}

constexpr const char* kBot = "<|begin_of_text|>";

TEST(ChatTemplateTest, Llama31DatedHeaderAlwaysWithTheTemplatesDate) {
  const auto t = ChatTemplate::recognise(realTemplate("llama3.1-instruct.jinja"), kBot, "<|eot_id|>", "3.1");
  EXPECT_EQ(t.family(), ChatTemplate::Family::kLlama3Dated);
  EXPECT_STREQ(t.family_name(), "Llama 3.1");
  EXPECT_EQ(t.end_of_turn(), "<|eot_id|>");
  EXPECT_EQ(t.today_date(), "26 Jul 2024");
  // No system message: the block is written with an empty one.
  EXPECT_EQ(t.format(std::nullopt, "  Hi \n"),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
            "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(t.format(" Be brief.\n", "Hi", /*enable_thinking=*/true, /*date_string=*/"27 Nov 2026"),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
            "Today Date: 27 Nov 2026\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  // The literals come from the template's text.
  const auto other = ChatTemplate::recognise(
      replaced(replaced(realTemplate("llama3.1-instruct.jinja"), "\"26 Jul 2024\"", "'01 Jan 2030'"),
               "December 2023", "March 2025"),
      kBot, "<|eot_id|>", "3.1");
  EXPECT_EQ(other.today_date(), "01 Jan 2030");
  EXPECT_NE(other.format(std::nullopt, "Hi").find("Cutting Knowledge Date: March 2025\nToday Date: 01 Jan 2030\n\n"),
            std::string::npos);
}

TEST(ChatTemplateTest, Llama32DatedHeaderHasTodaysDateUnlessGiven) {
  const std::string text = realTemplate("llama3.2-instruct.jinja");
  const auto t = ChatTemplate::recognise(text, kBot, "<|eot_id|>", "3.2");
  EXPECT_EQ(t.family(), ChatTemplate::Family::kLlama3Dated);
  // strftime_now("%d %b %Y"), as Python transformers renders it, e.g. "27 Nov 2026".
  const std::string today = todayIn("%d %b %Y");
  EXPECT_EQ(t.today_date(), today);
  EXPECT_NE(t.format("S", "Hi").find("Today Date: " + today + "\n\nS<|eot_id|>"), std::string::npos);
  EXPECT_EQ(t.today_date("05 Jan 2027"), "05 Jan 2027");
  EXPECT_EQ(t.format("S", "Hi", /*enable_thinking=*/true, /*date_string=*/"05 Jan 2027"),
            ChatTemplate::recognise(realTemplate("llama3.1-instruct.jinja"), kBot, "<|eot_id|>", "3.1")
                .format("S", "Hi", /*enable_thinking=*/true, /*date_string=*/"05 Jan 2027"));
  const auto iso = ChatTemplate::recognise(replaced(text, "%d %b %Y", "%Y-%m-%d %B"), kBot, "<|eot_id|>", "3.2");
  EXPECT_EQ(iso.today_date(), todayIn("%Y-%m-%d %B"));
  const std::string msg = any_error_of([&] { t.today_date(""); });
  EXPECT_NE(msg.find("bad date_string for the template of '3.2': got an empty string"), std::string::npos) << msg;
}

TEST(ChatTemplateTest, DatedLlama3VariantsAreRefusedByName) {
  const std::string l31 = realTemplate("llama3.1-instruct.jinja");
  const std::string l32 = realTemplate("llama3.2-instruct.jinja");
  const struct {
    std::string text;
    const char* expected;
  } cases[] = {
      {replaced(l32, "{{- system_message }}", "{{- '<|image|>' }}{{- system_message }}"),
       "got a Llama 3.2 Vision template (<|image|>)"},
      {replaced(l31, "{{- \"<|start_header_id|>system", "{%- if system_message %}{{- \"<|start_header_id|>system"),
       "writes its system block only for a system message"},
      {replaced(l31, "{%- set tools = none %}", "{%- set tools = [] %}"), "whose tools are not none by default"},
      {replaced(l31, "\"Today Date: \" + date_string", "\"Date: \" + date_string"),
       "without \"Today Date: \" + date_string + \"\\n\\n\""},
      {replaced(l31, "set date_string = \"26 Jul 2024\"", "set date_string = today"),
       "without a literal default for date_string"},
      {replaced(l32, "%d %b %Y", "%d %b %Y %Z"), "a strftime_now format with directives other than"},
      {replaced(l31, "messages[0]['content']|trim", "messages[0]['content']"), "without Llama 3.1's system block"},
  };
  for (const auto& c : cases) {
    const std::string msg = any_error_of([&] { ChatTemplate::recognise(c.text, kBot, "<|eot_id|>", "cfg"); });
    EXPECT_NE(msg.find("unsupported chat template in 'cfg': got"), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.expected), std::string::npos) << msg;
  }
}

TEST(ChatTemplateTest, Llama2ChatSystemInTheFirstTurnAndTheTurnStripped) {
  const std::string text = realTemplate("llama2-chat.jinja");
  const auto t = ChatTemplate::recognise(text, "<s>", "</s>", "l2");
  EXPECT_EQ(t.family(), ChatTemplate::Family::kLlama2);
  EXPECT_EQ(t.end_of_turn(), "</s>");
  EXPECT_EQ(t.format(std::nullopt, "  Hi \n"), "<s>[INST] Hi [/INST]");
  // The strip covers "<<SYS>>..." + user: the system keeps its white space.
  EXPECT_EQ(t.format(" Be brief. ", "  Hi \n"), "<s>[INST] <<SYS>>\n Be brief. \n<</SYS>>\n\n  Hi [/INST]");
  const std::string msg = any_error_of([&] {
    ChatTemplate::recognise(replaced(text, "{% else %}{% set loop_messages = messages %}",
                                     "{% elif USE_DEFAULT_PROMPT == true %}"
                                     "{% set system_message = 'DEFAULT_SYSTEM_MESSAGE' %}"
                                     "{% else %}{% set loop_messages = messages %}"),
                            "<s>", "</s>", "l2");
  });
  EXPECT_NE(msg.find("got Llama 2 chat's [INST] <<SYS>> template with a default system prompt"), std::string::npos)
      << msg;
}

class ChatFolderTest : public dtp::test::TempDirTest {};

TEST_F(ChatFolderTest, ReadsTheTemplateAndTokensOfAFolder) {
  dtp::test::write_bytes(file("tokenizer_config.json"),
                         json({{"bos_token", "<|begin_of_text|>"}, {"eos_token", "<|eot_id|>"},
                               {"chat_template", kLlama3Template}})
                             .dump());
  EXPECT_EQ(ChatTemplate::from_folder(dir_.string()).format(std::nullopt, "Hi"),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  dtp::test::write_bytes(file("tokenizer_config.json"), R"({"bos_token": "<s>"})");
  std::string msg = any_error_of([&] { ChatTemplate::from_folder(dir_.string()); });
  EXPECT_NE(msg.find("no chat template in '" + dir_.string() + "'"), std::string::npos) << msg;
  dtp::test::write_bytes(file("chat_template.jinja"), kLlama3Template);  // newer folders keep it apart
  dtp::test::write_bytes(file("tokenizer_config.json"), R"({"bos_token": "<|begin_of_text|>", "eos_token": "x"})");
  EXPECT_EQ(ChatTemplate::from_folder(dir_.string()).family(), ChatTemplate::Family::kLlama3);
  dtp::test::write_bytes(file("tokenizer_config.json"), R"({"chat_template": "{{ messa)");
  msg = any_error_of([&] { ChatTemplate::from_folder(dir_.string()); });
  EXPECT_NE(msg.find("bad JSON in '" + file("tokenizer_config.json") + "'"), std::string::npos) << msg;
}

TEST_F(ChatFolderTest, EndTokensFromGenerationConfigThenConfigThenTokenizer) {
  dtp::test::write_bytes(file("tokenizer.json"), sentencePieceStyle().dump());
  dtp::test::write_bytes(file("tokenizer_config.json"), R"({"eos_token": "</s>"})");
  const HfTokenizer tok(file("tokenizer.json"));
  EXPECT_EQ(end_token_ids(dir_.string(), tok), Ids{2});  // the tokenizer's eos
  dtp::test::write_bytes(file("config.json"), R"({"eos_token_id": 7})");
  EXPECT_EQ(end_token_ids(dir_.string(), tok), Ids{7});
  dtp::test::write_bytes(file("generation_config.json"), R"({"eos_token_id": [128001, 128008, 128009]})");
  EXPECT_EQ(end_token_ids(dir_.string(), tok), (Ids{128001, 128008, 128009}));
  dtp::test::write_bytes(file("generation_config.json"), R"({"eos_token_id": "x"})");
  const std::string msg = any_error_of([&] { end_token_ids(dir_.string(), tok); });
  EXPECT_NE(msg.find("bad eos_token_id in '" + file("generation_config.json") + "'"), std::string::npos) << msg;
}

// Byte-level BPE over all 256 bytes (GPT-2's byte-to-character map, no
// merges) with Qwen's chat tokens: <|im_start|> and <|im_end|> special,
// <tool_call> and </tool_call> not.
json everyByteChatMl() {
  json vocab = json::object();
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    std::string c;
    const int cp = printable ? b : next++;
    if (cp < 0x80) {
      c.push_back(static_cast<char>(cp));
    } else {
      c.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      c.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    vocab[c] = b;
  }
  json j = byteLevel();
  j["model"]["vocab"] = vocab;
  j["model"]["merges"] = json::array();
  j["post_processor"] = nullptr;
  j["added_tokens"] = {addedToken(256, "<|im_start|>", true), addedToken(257, "<|im_end|>", true),
                       addedToken(258, "<tool_call>", false), addedToken(259, "</tool_call>", false)};
  return j;
}

// A chat prompt and a tool call decode back to the text they were encoded
// from: templates and tool-call parsers see the special tokens.
TEST_F(ChatFolderTest, ChatPromptAndToolCallDecodeBackToTheirText) {
  REQUIRE_PCRE2();
  dtp::test::write_bytes(file("tokenizer.json"), everyByteChatMl().dump());
  dtp::test::write_bytes(file("tokenizer_config.json"),
                         json({{"eos_token", "<|im_end|>"},
                               {"chat_template",
                                "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' + "
                                "message.content + '<|im_end|>' + '\n' }}{%- endfor %}{%- if add_generation_prompt "
                                "%}{{- '<|im_start|>assistant\n' }}{%- endif %}"}})
                             .dump());
  const HfTokenizer tok(file("tokenizer.json"));
  const std::string call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
  const std::string prompt = ChatTemplate::from_folder(dir_.string()).format(
      {{"user", "Weather in Paris?"}, {"assistant", call}, {"user", "<tool_response>\n18 °C\n</tool_response>"}});
  const Ids ids = tok.encode(prompt, /*add_bos=*/false);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 256), 4) << "one <|im_start|> id per turn and the generation prompt";
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 258), 1) << "<tool_call> as its one id";
  EXPECT_EQ(tok.decode(ids), prompt);
  // Skipped, the special tokens go and the others stay, as in Hugging Face's.
  std::string without = prompt;
  for (const std::string special : {"<|im_start|>", "<|im_end|>"}) {
    for (size_t at; (at = without.find(special)) != std::string::npos;) without.erase(at, special.size());
  }
  EXPECT_EQ(tok.decode(ids, /*skip_special_tokens=*/true), without);
  // The reply as generated, token by token, then parsed.
  const Ids reply = tok.encode(call + "<|im_end|>", /*add_bos=*/false);
  std::string streamed;
  for (const int64_t id : reply) streamed += tok.decode_token(id);
  EXPECT_EQ(streamed, call + "<|im_end|>");
}

}  // namespace
}  // namespace dtp::models
