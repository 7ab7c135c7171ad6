// The BPE model of tokenizer.json ("model": {"type": "BPE"}), with the
// semantics of Hugging Face's tokenizers/src/models/bpe: merges by rank (the
// lowest first, the leftmost among equals), ignore_merges (a word found whole
// in the vocabulary is one token: Llama 3), byte_fallback to <0xNN> pieces,
// unk_token with fuse_unk, continuing_subword_prefix and end_of_word_suffix.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace dtp::models::hf {

struct BpeOptions {
  std::optional<std::string> unk_token;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  std::string continuing_subword_prefix;
  std::string end_of_word_suffix;
};

class Bpe {
 public:
  // A merge naming a token the vocabulary lacks, or whose result it lacks, is
  // an error naming `where` (the file), as Hugging Face refuses it.
  Bpe(std::unordered_map<std::string, int32_t> vocab, const std::vector<std::pair<std::string, std::string>>& merges,
      BpeOptions options, const std::string& where);

  // Appends the ids of one pre-tokenized word.
  void tokenize(const std::string& word, std::vector<int32_t>& out) const;

  std::optional<int32_t> token_to_id(const std::string& token) const;
  const std::vector<std::string>& id_to_token() const { return tokens_; }  // "" where no token has the id
  const BpeOptions& options() const { return options_; }

 private:
  void mergeWord(const std::string& word, std::vector<int32_t>& out) const;

  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::string> tokens_;
  // (left id << 32 | right id) -> (rank, merged id)
  std::unordered_map<uint64_t, std::pair<uint32_t, int32_t>> merges_;
  BpeOptions options_;
  std::optional<int32_t> unk_id_;
  // Words seen before, as Hugging Face's BPE cache (10,000 words under 256
  // bytes); guarded, since encode is const and may run on several threads.
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

}  // namespace dtp::models::hf
