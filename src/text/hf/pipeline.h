// The stages of a tokenizer.json around its model, each with the semantics of
// Hugging Face's `tokenizers` (the Rust library behind its Python and Node
// packages):
//   normalizer      Sequence, NFC, NFD, NFKC, NFKD, Prepend, Replace
//   pre_tokenizer   Sequence, Split, ByteLevel, Metaspace
//   post_processor  Sequence, TemplateProcessing, ByteLevel
//   decoder         Sequence, ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace
// Anything else is an error naming the type, the file and this list: these
// are what Llama 2/3, Mistral and Qwen 2.5/3 files use.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dtp::models::hf {

// A piece of the text on its way to the model. at_start: it begins at offset
// 0 of the caller's text (Metaspace's prepend_scheme "first" reads it, as HF
// reads offsets_original().0 == 0). token: the id of an added token matched
// there, which no later stage touches; -1 for text.
struct Piece {
  std::string text;
  bool at_start = false;
  int32_t token = -1;
};

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void normalize(std::string& text) const = 0;  // valid UTF-8 in and out
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Splits and rewrites the text pieces (token < 0); drops empty ones.
  virtual void pre_tokenize(std::vector<Piece>& pieces) const = 0;
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  // Hugging Face's decode_chain: tokens in, tokens out (joined by the caller).
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
  // One token in the middle of a stream: its bytes, with no lossy UTF-8
  // repair (a character may span tokens) and no positional rule (Strip,
  // Metaspace's first-token space).
  virtual void stream(std::string& token) const = 0;
};

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  // The ids with the special tokens of a single sequence added.
  virtual void process(std::vector<int32_t>& ids) const = 0;
  // The ids this adds before the sequence (for bos_id()).
  virtual std::vector<int32_t> prefix() const = 0;
};

// Each reads one JSON object of tokenizer.json; `where` is the file's path.
// A null JSON gives nullptr (no such stage).
std::unique_ptr<Normalizer> make_normalizer(const nlohmann::json& j, const std::string& where);
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const nlohmann::json& j, const std::string& where);
std::unique_ptr<Decoder> make_decoder(const nlohmann::json& j, const std::string& where);
std::unique_ptr<PostProcessor> make_post_processor(const nlohmann::json& j, const std::string& where);

// Byte-level BPE's alphabet (GPT-2's bytes_to_unicode): byte -> code point.
char32_t byte_to_char(unsigned char b);

// A typed field of a tokenizer.json object, or an error naming the file.
const nlohmann::json& field(const nlohmann::json& j, const char* key, const char* component, const std::string& where);
std::string string_field(const nlohmann::json& j, const char* key, const char* component, const std::string& where);
bool bool_field(const nlohmann::json& j, const char* key, bool fallback, const char* component,
                const std::string& where);

}  // namespace dtp::models::hf
