// DecodeStream: see NOTE: [Decode stream window] in dtp/text/decode_stream.h.
#include "dtp/text/decode_stream.h"

#include "dtp/text/hf_tokenizer.h"

#include <c10/util/Exception.h>

#include <cstdio>

namespace dtp::models {
namespace {

// Whether `bytes` ends inside a UTF-8 character: a lead byte (C0-F7) followed
// by fewer continuation bytes than it announces. Lenient on purpose (an
// overlong or surrogate prefix is held too): holding longer costs only
// latency, settling early would be wrong.
bool endsInsideCharacter(const std::string& bytes) {
  const size_t n = bytes.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const auto c = static_cast<unsigned char>(bytes[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const size_t need = c >= 0xF8 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return need > back;
  }
  return false;  // ASCII, or 3 continuation bytes: any lead before them is decided
}

bool startsWith(const std::string& s, const std::string& prefix) {
  return s.size() >= prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}

}  // namespace

DecodeStream::DecodeStream(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {
  // See NOTE: [Decode stream window] for why these three kinds are local.
  const auto* hf = dynamic_cast<const HfTokenizer*>(&tokenizer);
  local_ = hf != nullptr || dynamic_cast<const ByteTokenizer*>(&tokenizer) != nullptr ||
           dynamic_cast<const SentencePieceTokenizer*>(&tokenizer) != nullptr;
  if (hf == nullptr) return;
  drop_special_ = skip_special_tokens;
  // Rule (b): byte-fallback runs that decode all or nothing. Asked of the
  // decoder itself: <0xE4><0x41> is "\uFFFD\uFFFD" under Hugging Face's
  // ByteFallback, "<0xE4><0x41>" without it.
  std::vector<int64_t> bytes(256, -1);
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    if (const auto id = hf->token_to_id(name)) bytes[static_cast<size_t>(b)] = *id;
  }
  if (bytes[0xE4] < 0 || bytes[0x41] < 0) return;
  if (hf->decode({bytes[0xE4], bytes[0x41]}) != "\xEF\xBF\xBD\xEF\xBF\xBD") return;
  byte_fallback_.assign(static_cast<size_t>(hf->vocab_size()), false);
  for (const int64_t id : bytes) {
    if (id >= 0) byte_fallback_[static_cast<size_t>(id)] = true;
  }
}

bool DecodeStream::held(int64_t id, const std::string& bytes) {
  tail_ += bytes;
  if (tail_.size() > 3) tail_.erase(0, tail_.size() - 3);
  if (endsInsideCharacter(tail_)) return true;  // rule (a)
  return !byte_fallback_.empty() && byte_fallback_[static_cast<size_t>(id)];  // rule (b)
}

std::string DecodeStream::step(int64_t id) {
  TORCH_CHECK(!flushed_, "DecodeStream::step: a step after flush() for tokenizer ", tokenizer_.name(),
              ": got id ", id, ", expected no more ids. Start a new DecodeStream for a new sequence.");
  const int64_t vocab = tokenizer_.vocab_size();
  TORCH_CHECK(id >= 0 && id < vocab, "DecodeStream::step: token id out of range for tokenizer ", tokenizer_.name(),
              ": got ", id, ", expected 0 <= id < ", vocab, ". Drop ids of a model's padded vocabulary before the "
              "stream (they have no text).");
  if (drop_special_ && static_cast<const HfTokenizer&>(tokenizer_).is_special(id)) return "";
  const std::string bytes = tokenizer_.decode_token(id, skip_special_tokens_);
  // A skipped sentencepiece control id between settled texts changes no
  // text; inside a held byte run it ends the run, so it stays there.
  if (bytes.empty() && !holding_ && local_) return "";
  ids_.push_back(id);
  visible_.push_back(bytes.empty() ? 0 : 1);
  holding_ = held(id, bytes);
  if (holding_) return "";
  std::string text = tokenizer_.decode(ids_, skip_special_tokens_);
  TORCH_INTERNAL_ASSERT(startsWith(text, prefix_text_), "DecodeStream: the window's text no longer starts with its "
                        "context's for tokenizer ", tokenizer_.name(), " (see NOTE: [Decode stream window])");
  std::string out = text.substr(prefix_text_.size());
  prefix_text_ = std::move(text);
  read_ = ids_.size();
  if (local_) keepContext();
  return out;
}

// After a send: the window keeps its last kContextIds visible ids (and the
// invisible ones among them), more while their text is "" (a start rule
// took all of it, e.g. Strip(start 8) over four "▁"), and they become the
// context. See NOTE: [Decode stream window], (2).
void DecodeStream::keepContext() {
  size_t from = ids_.size(), seen = 0;
  while (from > 0 && seen < kContextIds) seen += visible_[--from] ? 1 : 0;
  for (; from > 0; --from) {
    const std::vector<int64_t> context(ids_.begin() + static_cast<std::ptrdiff_t>(from), ids_.end());
    std::string text = tokenizer_.decode(context, skip_special_tokens_);
    if (text.empty()) continue;
    ids_ = context;
    visible_.erase(visible_.begin(), visible_.begin() + static_cast<std::ptrdiff_t>(from));
    read_ = ids_.size();
    prefix_text_ = std::move(text);
    return;
  }
  // from == 0: the whole window stays the context; prefix_text_ is its text.
}

std::string DecodeStream::flush() {
  TORCH_CHECK(!flushed_, "DecodeStream::flush: called twice for tokenizer ", tokenizer_.name(),
              ": got a second flush(), expected one at the end of the sequence. Call it once.");
  flushed_ = true;
  if (read_ == ids_.size()) return "";
  const std::string text = tokenizer_.decode(ids_, skip_special_tokens_);
  TORCH_INTERNAL_ASSERT(startsWith(text, prefix_text_), "DecodeStream: the window's text no longer starts with its "
                        "context's for tokenizer ", tokenizer_.name(), " (see NOTE: [Decode stream window])");
  return text.substr(prefix_text_.size());
}

}  // namespace dtp::models
