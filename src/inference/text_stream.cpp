#include "text_stream.h"

#include <algorithm>

namespace dtp::inference {

size_t complete_utf8_prefix(const std::string& s) {
  // Look back at most 3 bytes for a lead byte whose sequence is cut.
  const size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const auto c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: keep looking
    const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return need > back ? n - back : n;
  }
  return n;
}

void TextStream::append(const std::string& piece) {
  if (stopped_) return;
  text_ += piece;
  // A stop string may end in the new text only, but may start up to its
  // length before it.
  size_t longest = 0;
  for (const auto& s : stops_) longest = std::max(longest, s.size());
  const size_t from = sent_ > longest ? sent_ - longest : 0;
  size_t cut = std::string::npos;
  for (const auto& s : stops_) {
    if (s.empty()) continue;
    const size_t at = text_.find(s, from);
    if (at != std::string::npos) cut = std::min(cut, at);
  }
  if (cut != std::string::npos) {
    text_.resize(std::max(cut, sent_));  // what was sent stays sent (it never held the stop string)
    stopped_ = true;
  }
}

std::string TextStream::take() {
  size_t end = text_.size();
  if (!final_ && !stopped_) {
    // See NOTE: [Settled text].
    end = complete_utf8_prefix(text_);
    static const std::string kReplacement = "\xEF\xBF\xBD";
    if (end >= kReplacement.size() && text_.compare(end - kReplacement.size(), kReplacement.size(), kReplacement) == 0)
      end -= kReplacement.size();
    for (const auto& s : stops_) {
      if (s.empty()) continue;
      // Hold back the longest tail that is a proper prefix of a stop string.
      for (size_t k = std::min(s.size() - 1, end); k > 0; --k) {
        if (text_.compare(end - k, k, s, 0, k) == 0) {
          end -= k;
          break;
        }
      }
    }
  }
  if (end <= sent_) return "";
  std::string out = text_.substr(sent_, end - sent_);
  sent_ = end;
  return out;
}

}  // namespace dtp::inference
