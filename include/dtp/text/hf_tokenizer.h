// Hugging Face fast tokenizers (tokenizer.json), read without Python: the
// byte-level BPE of Llama 3 and Qwen 2.5/3 and the sentencepiece-style BPE of
// Llama 2 and Mistral, with the semantics of Hugging Face's `tokenizers`.
#pragma once

#include "dtp/text/tokenizer.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dtp::models {

// A tokenizer.json, as Hugging Face's `tokenizers` (and so AutoTokenizer)
// runs it:
//   - added tokens ("<|begin_of_text|>", "<|im_start|>", ...) are matched in
//     the text first, longest at the leftmost place, and encode as their one
//     id, whether special or not;
//   - the rest goes through the file's normalizer, pre-tokenizer (split
//     regexes through PCRE2, their \s, \p{L} and \p{N} matching the code
//     points Hugging Face's match: Unicode 16.0, not PCRE2's own version)
//     and BPE model;
//   - encode(text, /*add_bos=*/true) adds what the post-processor adds (HF's
//     add_special_tokens=True): Llama 3.1's file adds <|begin_of_text|>, the
//     first Llama 3 files and Qwen's add nothing, Llama 2's adds <s>;
//   - decode runs the file's decoder over the tokens, special ones included
//     unless skip_special_tokens (HF's decode(ids, skip_special_tokens),
//     false by default as there). Hugging Face transformers' clean_up_
//     tokenization_spaces (a Python-side rewrite of " ." etc.) is not applied.
// Bytes that are not UTF-8 are replaced first, as HF's callers must (NOTE:
// [Invalid UTF-8 becomes U+FFFD] in src/text/hf/unicode_text.h).
// bos_id()/eos_id() come from tokenizer_config.json beside the file
// (bos_token, eos_token) when it is there; else BOS is the post-processor's
// first added id, and EOS is unknown.
// Supported: model BPE; normalizers Sequence, NFC/NFD/NFKC/NFKD (utf8proc),
// Prepend, Replace; pre-tokenizers Sequence, Split, ByteLevel, Metaspace;
// post-processors Sequence, TemplateProcessing, ByteLevel; decoders Sequence,
// ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace. Anything else
// (Unigram, WordPiece, WordLevel, BertPreTokenizer, ...) is an error naming
// the type and the file, as is a truncated or corrupt file.
class HfTokenizer final : public Tokenizer {
 public:
  explicit HfTokenizer(const std::string& tokenizer_json);
  ~HfTokenizer() override;

  std::vector<int64_t> encode(const std::string& text, bool add_bos) const override;
  // One more than the largest id, added tokens included (Llama 3: 128256;
  // Qwen 2.5: 151665, which the model pads to 151936).
  int64_t vocab_size() const override;
  std::optional<int64_t> bos_id() const override;
  std::optional<int64_t> eos_id() const override;
  std::string name() const override;  // "tokenizer.json <path>"

  // The id of a token: an added token's, else the model vocabulary's.
  std::optional<int64_t> token_to_id(const std::string& token) const;
  // Whether `id` is an added token marked special.
  bool is_special(int64_t id) const;
  const std::string& path() const;

 protected:
  std::string decode_ids(const std::vector<int64_t>& ids, bool skip_special_tokens) const override;
  // A special token gives its text ("" when skipped); a byte-level token its
  // bytes; "▁" is a space and <0xNN> its byte in the sentencepiece-style form.
  std::string decode_one(int64_t id, bool skip_special_tokens) const override;

 private:
  struct Impl;
  std::unique_ptr<const Impl> impl_;
};

}  // namespace dtp::models
