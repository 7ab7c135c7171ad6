// Tokenizers for dtp's apps (dtp-train, dtp-generate): text <-> token ids.
//
// Three kinds:
//   - ByteTokenizer: every byte is a token (vocab 256, no BOS/EOS), the
//     default, which needs no file;
//   - SentencePieceTokenizer: a sentencepiece `tokenizer.model` (Llama 1/2,
//     Mistral), read through Debian's libsentencepiece, with the semantics of
//     Hugging Face's LlamaTokenizer;
//   - HfTokenizer (hf_tokenizer.h): a Hugging Face `tokenizer.json` (Llama
//     2/3, Mistral, Qwen 2.5/3), with the semantics of Hugging Face's
//     `tokenizers`.
// load_tokenizer picks one from a path. Llama 3's tiktoken `tokenizer.model`
// and unsupported files are errors that say so, never a silent fall back to
// bytes.
//
// Library dtp::text (folder include/dtp/text/, src/text/): no DTensor, and
// the only dtp library that links PCRE2, utf8proc and (as a module)
// sentencepiece. Its names stay in namespace dtp::models, where they were
// before the move (NOTE: [Moved headers] in dtp/models/tokenizer.h).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dtp::models {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // The ids of `text`, after bos_id() when add_bos is true and the tokenizer
  // has one (ByteTokenizer has none: add_bos adds nothing there). No EOS.
  // HfTokenizer: add_bos adds what its tokenizer.json's post-processor adds
  // (Hugging Face's add_special_tokens), which for some files is nothing
  // even though bos_id() is set (the first Llama 3 files).
  virtual std::vector<int64_t> encode(const std::string& text, bool add_bos) const = 0;

  // The text of `ids`, as Hugging Face's decode(ids, skip_special_tokens):
  // special tokens (BOS, EOS, an HfTokenizer's special added tokens such as
  // <|im_start|> or <|python_tag|>) decode to their text, so that a chat
  // prompt or a tool call decodes back to what was encoded, unless
  // skip_special_tokens is true (generated text shown to a user: dtp-generate
  // and dtp-serve pass true). Byte-fallback tokens that form no valid UTF-8
  // decode to U+FFFD, as in sentencepiece. An id outside [0, vocab_size()) is
  // an error.
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = false) const {
    return decode_ids(ids, skip_special_tokens);
  }

  // The bytes one id adds in the middle of a text, for streaming output:
  // sentencepiece's "▁" is a space, and a byte-fallback token is its one byte
  // (so a multi-byte character may arrive over several calls). Concatenated
  // over encode(s) this gives s, except that sentencepiece's dummy prefix
  // shows as a leading space, which decode drops: e.g. "▁Hello" gives
  // " Hello". A special token gives its text, or "" when
  // skip_special_tokens is true, as in decode.
  std::string decode_token(int64_t id, bool skip_special_tokens = false) const {
    return decode_one(id, skip_special_tokens);
  }

  virtual int64_t vocab_size() const = 0;
  virtual std::optional<int64_t> bos_id() const = 0;
  virtual std::optional<int64_t> eos_id() const = 0;

  // For logs: "byte", or "sentencepiece <path>".
  virtual std::string name() const = 0;

 protected:
  // decode and decode_token, which keep the default argument out of the
  // virtual functions.
  virtual std::string decode_ids(const std::vector<int64_t>& ids, bool skip_special_tokens) const = 0;
  virtual std::string decode_one(int64_t id, bool skip_special_tokens) const = 0;
};

// A byte is a token: ids 0..255, no BOS or EOS, decode(encode(s)) == s for
// any bytes, UTF-8 or not.
class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<int64_t> encode(const std::string& text, bool add_bos) const override;
  int64_t vocab_size() const override { return 256; }
  std::optional<int64_t> bos_id() const override { return std::nullopt; }
  std::optional<int64_t> eos_id() const override { return std::nullopt; }
  std::string name() const override { return "byte"; }

 protected:
  // No token is special: skip_special_tokens changes nothing.
  std::string decode_ids(const std::vector<int64_t>& ids, bool skip_special_tokens) const override;
  std::string decode_one(int64_t id, bool skip_special_tokens) const override;
};

// A sentencepiece model (Llama 2's tokenizer.model: BPE, byte fallback,
// unk 0, bos 1, eos 2). Encoding follows the model's own normalizer spec,
// add_dummy_prefix included, as Hugging Face's LlamaTokenizer does: encode
// ("Hello", /*add_bos=*/true) is {1, <ids of "▁Hello">}. Debian's
// libsentencepiece does the work from a module of dtp's,
// libdtp_sentencepiece.so, loaded on first use (found where dtp was built or
// installed, or at $DTP_SENTENCEPIECE_MODULE).
class SentencePieceTokenizer final : public Tokenizer {
 public:
  // A missing, truncated or corrupt file is an error naming it.
  explicit SentencePieceTokenizer(const std::string& model_path);
  ~SentencePieceTokenizer() override;

  std::vector<int64_t> encode(const std::string& text, bool add_bos) const override;
  int64_t vocab_size() const override;
  std::optional<int64_t> bos_id() const override;
  std::optional<int64_t> eos_id() const override;
  std::string name() const override { return "sentencepiece " + path_; }

 protected:
  // Control pieces (<s>, </s>) are the special tokens: kept, each decodes to
  // its piece ("<s>") and the text between them as sentencepiece decodes it.
  std::string decode_ids(const std::vector<int64_t>& ids, bool skip_special_tokens) const override;
  std::string decode_one(int64_t id, bool skip_special_tokens) const override;

 private:
  class Model;  // the module's handle
  std::string path_;
  std::unique_ptr<Model> model_;
};

// The tokenizer at `path`:
//   - "" or "byte": ByteTokenizer;
//   - a tokenizer.json file (a JSON file, whatever its name): HfTokenizer;
//   - a sentencepiece model file (named tokenizer.model or otherwise);
//   - a folder (a Hugging Face model folder): its tokenizer.json when it has
//     one, as Hugging Face's AutoTokenizer prefers the fast tokenizer, else
//     its tokenizer.model.
// Anything else is an error naming the file and what is supported: a tiktoken
// tokenizer.model (Llama 3's original/), a tokenizer.json dtp cannot run
// (see HfTokenizer), a missing path, a folder with neither file.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path);

// Checks that every id of `tokenizer` is a row of a model's embedding of
// `model_vocab_size` rows (`model` names it in the error, e.g. its
// config.json): a tokenizer with more ids is an error naming both. A larger
// model vocabulary is fine (Qwen 2.5 pads 151665 ids to 151936 rows).
void check_tokenizer_fits_model(const Tokenizer& tokenizer, int64_t model_vocab_size, const std::string& model);

}  // namespace dtp::models
