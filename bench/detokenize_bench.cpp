// The text cost of one generated token in a serving step loop, before and
// after DecodeStream (#56 item 3), side by side in one run:
//   full    decode(all ids so far) and a TextStream-like update/take (what
//           dtp-serve's step loop did: NOTE: [Settled text]), O(sequence) per
//           token;
//   stream  DecodeStream::step(id), O(window) per token (NOTE: [Decode stream
//           window]).
// The ids are a real text's (English prose, code, CJK, emoji) encoded by the
// tokenizer, cut to --tokens. Each rep runs both over the whole sequence, in
// alternating order; a token's cost is the median over reps at its position,
// and the table gives the mean of those medians over the 10 positions ending
// at 100, 500, 1000, 2000 (...). DecodeStream's text must equal
// decode(ids), else the program exits 1; whether the full-decode loop's does
// is printed.
//
//   dtp_detokenize_bench [--tokenizer PATH] [--tokens N] [--reps R]
#include "dtp/text/decode_stream.h"
#include "dtp/text/tokenizer.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

namespace {

using dtp::models::DecodeStream;
using dtp::models::Tokenizer;
using Clock = std::chrono::steady_clock;

// What dtp-serve's TextStream did per token without stop strings: keep the
// whole text, send what is settled (no cut UTF-8 character, no trailing
// U+FFFD).
class FullDecodeStream {
 public:
  explicit FullDecodeStream(const Tokenizer& tok) : tok_(tok) {}
  std::string step(int64_t id) {
    ids_.push_back(id);
    text_ = tok_.decode(ids_, /*skip_special_tokens=*/true);
    size_t end = completePrefix(text_);
    static const std::string kReplacement = "\xEF\xBF\xBD";
    if (end >= 3 && text_.compare(end - 3, 3, kReplacement) == 0) end -= 3;
    if (end <= sent_) return "";
    std::string out = text_.substr(sent_, end - sent_);
    sent_ = end;
    return out;
  }
  std::string flush() const { return text_.substr(sent_); }

 private:
  static size_t completePrefix(const std::string& s) {
    const size_t n = s.size();
    for (size_t back = 1; back <= 3 && back <= n; ++back) {
      const auto c = static_cast<unsigned char>(s[n - back]);
      if ((c & 0xC0) == 0x80) continue;
      const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
      return need > back ? n - back : n;
    }
    return n;
  }
  const Tokenizer& tok_;
  std::vector<int64_t> ids_;
  std::string text_;
  size_t sent_ = 0;
};

const char* const kText =
    "The scheduler admits a request when its prompt fits in the free blocks of the cache, then runs one step for "
    "every running sequence: a forward of the new tokens, sampling, and the text of each new token streamed back "
    "to the client as server-sent events. Long answers are the common case for chat models, and a quadratic cost "
    "in the length of the answer shows up as a slower tail. \n\n```cpp\nfor (size_t i = 0; i < ids.size(); ++i) {\n"
    "  text += stream.step(ids[i]);\n}\n```\n\n"
    "中文：增量解码让每个词元的文本成本与序列长度无关。日本語：ストリーミング出力。한국어 텍스트도 있습니다. "
    "Emoji 😀👍🏽 and accents: café, naïve, Ångström.\n";

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string path = "byte";
  size_t tokens = 2000;
  int reps = 15;
  for (int i = 1; i < argc; ++i) {
    const auto value = [&](const char* flag) -> const char* {
      if (std::strcmp(argv[i], flag) != 0 || i + 1 >= argc) return nullptr;
      return argv[++i];
    };
    if (const char* v = value("--tokenizer")) {
      path = v;
    } else if (const char* v = value("--tokens")) {
      tokens = std::stoul(v);
    } else if (const char* v = value("--reps")) {
      reps = std::max(1, std::stoi(v));
    } else {
      std::cerr << "usage: dtp_detokenize_bench [--tokenizer PATH] [--tokens N] [--reps R]\n";
      return 2;
    }
  }
  const std::unique_ptr<Tokenizer> tok = dtp::models::load_tokenizer(path);
  std::string text;
  std::vector<int64_t> ids;
  while (ids.size() < tokens) {
    text += kText;
    ids = tok->encode(text, /*add_bos=*/false);
  }
  ids.resize(tokens);

  std::vector<std::vector<double>> full_us(tokens), stream_us(tokens);
  std::string full_text, stream_text;
  for (int rep = 0; rep < reps; ++rep) {
    for (int pass = 0; pass < 2; ++pass) {
      const bool run_full = (pass == 0) == (rep % 2 == 0);
      std::string out;
      if (run_full) {
        FullDecodeStream s(*tok);
        for (size_t k = 0; k < tokens; ++k) {
          const auto t0 = Clock::now();
          out += s.step(ids[k]);
          full_us[k].push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
        }
        full_text = out + s.flush();
      } else {
        DecodeStream s(*tok, /*skip_special_tokens=*/true);
        for (size_t k = 0; k < tokens; ++k) {
          const auto t0 = Clock::now();
          out += s.step(ids[k]);
          stream_us[k].push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
        }
        stream_text = out + s.flush();
      }
    }
  }
  // Where a text first leaves decode(ids): the byte offset and a few bytes.
  const auto firstDifference = [](const std::string& got, const std::string& want) {
    size_t at = 0;
    while (at < got.size() && at < want.size() && got[at] == want[at]) ++at;
    char line[160];
    std::snprintf(line, sizeof(line), "differs from byte %zu of %zu (got %zu bytes)", at, want.size(), got.size());
    return std::string(line);
  };
  const std::string expected = tok->decode(ids, /*skip_special_tokens=*/true);
  if (stream_text != expected) {
    std::cerr << "dtp_detokenize_bench: FAIL: DecodeStream's text " << firstDifference(stream_text, expected)
              << " of decode(ids)\n";
    return 1;
  }
  // The full-decode loop is the baseline, not under test: with Llama 2's
  // tokenizer.json it sends U+FFFD for a character that a later byte of its
  // byte-fallback run makes valid (NOTE: [Decode stream window], rule (b)).
  const std::string full_note =
      full_text == expected ? "equal" : "DIFFERENT: " + firstDifference(full_text, expected);

  std::printf("tokenizer: %s\nids: %zu (%zu bytes of text), reps: %d\n", tok->name().c_str(), tokens,
              expected.size(), reps);
  std::printf("full-decode loop's text against decode(ids): %s\n\n", full_note.c_str());
  std::printf("| tokens so far | full decode us/token | DecodeStream us/token | full / stream |\n");
  std::printf("|---:|---:|---:|---:|\n");
  std::vector<size_t> at;
  for (const size_t k : {100, 500, 1000, 2000, 4000, 8000}) {
    if (k <= tokens) at.push_back(k);
  }
  if (at.empty() || at.back() != tokens) at.push_back(tokens);
  for (const size_t k : at) {
    double f = 0, s = 0;
    const size_t from = k >= 10 ? k - 10 : 0;
    for (size_t p = from; p < k; ++p) {
      f += median(full_us[p]);
      s += median(stream_us[p]);
    }
    f /= static_cast<double>(k - from);
    s /= static_cast<double>(k - from);
    std::printf("| %zu | %.2f | %.2f | %.1f |\n", k, f, s, f / s);
  }
  double f = 0, s = 0;
  for (size_t p = 0; p < tokens; ++p) {
    f += median(full_us[p]);
    s += median(stream_us[p]);
  }
  std::printf("\nwhole sequence (sum of medians): full %.1f ms, DecodeStream %.2f ms (%.2f us/token)\n", f / 1000,
              s / 1000, s / static_cast<double>(tokens));
  std::printf("dtp_detokenize_bench: texts equal decode(ids)\n");
  return 0;
}
