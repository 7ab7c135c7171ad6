#include "text/hf/bpe.h"

#include "text/hf/unicode_text.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <queue>

namespace dtp::models::hf {
namespace {

constexpr size_t kCacheWords = 10000;
constexpr size_t kCacheMaxWordBytes = 256;

uint64_t pairKey(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

struct Symbol {
  int32_t id;
  int prev;
  int next;
  size_t len;  // 0: merged into its left neighbour
};

struct Merge {
  uint32_t rank;
  int pos;
  int32_t new_id;
  // std::priority_queue pops the largest: the lowest rank, then the leftmost.
  bool operator<(const Merge& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
};

}  // namespace

Bpe::Bpe(std::unordered_map<std::string, int32_t> vocab, const std::vector<std::pair<std::string, std::string>>& merges,
         BpeOptions options, const std::string& where)
    : vocab_(std::move(vocab)), options_(std::move(options)) {
  int32_t max_id = -1;
  for (const auto& [token, id] : vocab_) {
    TORCH_CHECK(id >= 0, "HfTokenizer: bad vocabulary in '", where, "': got id ", id, " for token '", token,
                "', expected ids >= 0. The file is corrupt.");
    max_id = std::max(max_id, id);
  }
  tokens_.assign(static_cast<size_t>(max_id + 1), std::string());
  for (const auto& [token, id] : vocab_) tokens_[static_cast<size_t>(id)] = token;
  const size_t prefix = options_.continuing_subword_prefix.size();
  const auto idOf = [&](const std::string& token, size_t rank) {
    const auto it = vocab_.find(token);
    TORCH_CHECK(it != vocab_.end(), "HfTokenizer: bad merge ", rank, " in '", where, "': got the token '", token,
                "', which the vocabulary lacks, expected merges of vocabulary tokens. The file is corrupt.");
    return it->second;
  };
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    const int32_t a_id = idOf(a, rank);
    const int32_t b_id = idOf(b, rank);
    TORCH_CHECK(b.size() >= prefix, "HfTokenizer: bad merge ", rank, " in '", where, "': got '", b,
                "', shorter than the continuing_subword_prefix. The file is corrupt.");
    const int32_t merged = idOf(a + b.substr(prefix), rank);
    merges_[pairKey(a_id, b_id)] = {static_cast<uint32_t>(rank), merged};  // a later duplicate wins, as in HF
  }
  if (options_.unk_token) {
    const auto it = vocab_.find(*options_.unk_token);
    TORCH_CHECK(it != vocab_.end(), "HfTokenizer: bad unk_token in '", where, "': got '", *options_.unk_token,
                "', which the vocabulary lacks. The file is corrupt.");
    unk_id_ = it->second;
  }
}

std::optional<int32_t> Bpe::token_to_id(const std::string& token) const {
  const auto it = vocab_.find(token);
  return it == vocab_.end() ? std::nullopt : std::optional<int32_t>(it->second);
}

void Bpe::tokenize(const std::string& word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (options_.ignore_merges) {
    if (const auto it = vocab_.find(word); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() < kCacheMaxWordBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (const auto it = cache_.find(word); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t before = out.size();
  mergeWord(word, out);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() < kCacheWords) cache_.emplace(word, std::vector<int32_t>(out.begin() + before, out.end()));
  }
}

// Hugging Face's BPE::merge_word and Word::merge_all, step for step: the
// characters (with prefix/suffix) become symbols, unknown ones become byte
// pieces or unk (a pending unk is emitted only when the next known character
// comes, after any byte pieces: HF's order); then a queue merges the pair of
// lowest rank, leftmost first, skipping entries that went stale.
void Bpe::mergeWord(const std::string& word, std::vector<int32_t>& out) const {
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  const auto add = [&](int32_t id, size_t len) {
    const int n = static_cast<int>(symbols.size());
    symbols.push_back({id, n - 1, n + 1, len});
  };
  std::optional<std::pair<int32_t, size_t>> unk;
  std::string piece;
  for (size_t at = 0; at < word.size();) {
    const size_t len = std::min(utf8_length(static_cast<unsigned char>(word[at])), word.size() - at);
    piece.assign(word, at, len);
    if (at > 0 && !options_.continuing_subword_prefix.empty()) piece.insert(0, options_.continuing_subword_prefix);
    if (at + len == word.size()) piece += options_.end_of_word_suffix;
    at += len;
    if (const auto it = vocab_.find(piece); it != vocab_.end()) {
      if (unk) {
        add(unk->first, unk->second);
        unk.reset();
      }
      add(it->second, len);
      continue;
    }
    if (options_.byte_fallback) {
      std::vector<int32_t> bytes;
      char name[8];
      for (const char c : piece) {
        std::snprintf(name, sizeof(name), "<0x%02X>", static_cast<unsigned char>(c));
        const auto it = vocab_.find(name);
        if (it == vocab_.end()) break;
        bytes.push_back(it->second);
      }
      if (bytes.size() == piece.size()) {
        for (const int32_t id : bytes) add(id, 1);
        continue;
      }
    }
    if (unk_id_) {
      if (unk && options_.fuse_unk) {
        unk->second += len;
      } else {
        if (unk) add(unk->first, unk->second);
        unk = std::make_pair(*unk_id_, len);
      }
    }
  }
  if (unk) add(unk->first, unk->second);
  if (symbols.empty()) return;
  symbols.back().next = -1;

  std::priority_queue<Merge> queue;
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const auto it = merges_.find(pairKey(symbols[i].id, symbols[i + 1].id)); it != merges_.end()) {
      queue.push({it->second.first, static_cast<int>(i), it->second.second});
    }
  }
  while (!queue.empty()) {
    const Merge top = queue.top();
    queue.pop();
    Symbol& cur = symbols[static_cast<size_t>(top.pos)];
    if (cur.len == 0 || cur.next == -1) continue;
    const int next_pos = cur.next;
    const Symbol right = symbols[static_cast<size_t>(next_pos)];
    const auto now = merges_.find(pairKey(cur.id, right.id));
    if (now == merges_.end() || now->second.second != top.new_id) continue;  // stale
    cur.id = top.new_id;
    cur.len += right.len;
    cur.next = right.next;
    symbols[static_cast<size_t>(next_pos)].len = 0;
    if (right.next >= 0) symbols[static_cast<size_t>(right.next)].prev = top.pos;
    if (cur.prev >= 0) {
      const Symbol& prev = symbols[static_cast<size_t>(cur.prev)];
      if (const auto it = merges_.find(pairKey(prev.id, cur.id)); it != merges_.end()) {
        queue.push({it->second.first, cur.prev, it->second.second});
      }
    }
    if (cur.next >= 0) {
      const Symbol& nxt = symbols[static_cast<size_t>(cur.next)];
      if (const auto it = merges_.find(pairKey(cur.id, nxt.id)); it != merges_.end()) {
        queue.push({it->second.first, top.pos, it->second.second});
      }
    }
  }
  for (const Symbol& s : symbols) {
    if (s.len != 0) out.push_back(s.id);
  }
}

}  // namespace dtp::models::hf
