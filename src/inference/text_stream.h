// The text of a generated sequence as it grows, for streaming: what may be
// sent now, and where a stop string ends it.
//
//   TextStream s(stops);
//   s.append(decode_stream.step(id));  // after each token (dtp/text/decode_stream.h)
//   send(s.take());                    // the new, settled part
//   if (s.stopped()) ...               // a stop string was found: the text ends before it
//
// NOTE: [Settled text] The text grows by what DecodeStream settles per token
// (its pieces concatenate to the decode of all ids). Text is held back while
//  - it ends in an incomplete UTF-8 sequence (byte tokens) or in U+FFFD
//    (a byte-fallback character whose other bytes may still come);
//  - its end could be the start of a stop string.
// So the streamed pieces concatenate to exactly the final text.
#pragma once

#include <string>
#include <vector>

namespace dtp::inference {

class TextStream {
 public:
  explicit TextStream(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  // More of the decoded text.
  void append(const std::string& piece);
  // The settled text not yet taken; finish() settles all of it.
  std::string take();
  void finish() { final_ = true; }
  bool stopped() const { return stopped_; }
  const std::string& text() const { return text_; }

 private:
  std::vector<std::string> stops_;
  std::string text_;
  size_t sent_ = 0;
  bool stopped_ = false, final_ = false;
};

// The length of the longest prefix of `s` that does not end inside a UTF-8
// sequence (a trailing lead byte without all its continuation bytes).
size_t complete_utf8_prefix(const std::string& s);

}  // namespace dtp::inference
