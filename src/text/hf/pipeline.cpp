#include "text/hf/pipeline.h"

#include "text/hf/regex.h"
#include "text/hf/unicode_text.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstdlib>

namespace dtp::models::hf {

using nlohmann::json;

// --- JSON fields ---

const json& field(const json& j, const char* key, const char* component, const std::string& where) {
  TORCH_CHECK(j.is_object() && j.contains(key), "HfTokenizer: missing field in '", where, "': got a ", component,
              " without \"", key, "\" (", j.dump().substr(0, 200), "), expected one. The file is corrupt or of a "
              "format dtp does not know.");
  return j.at(key);
}

std::string string_field(const json& j, const char* key, const char* component, const std::string& where) {
  const json& v = field(j, key, component, where);
  TORCH_CHECK(v.is_string(), "HfTokenizer: bad field in '", where, "': got ", component, ".", key, " = ",
              v.dump().substr(0, 200), ", expected a string. The file is corrupt.");
  return v.get<std::string>();
}

bool bool_field(const json& j, const char* key, bool fallback, const char* component, const std::string& where) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  const json& v = j.at(key);
  TORCH_CHECK(v.is_boolean(), "HfTokenizer: bad field in '", where, "': got ", component, ".", key, " = ",
              v.dump().substr(0, 200), ", expected true or false. The file is corrupt.");
  return v.get<bool>();
}

namespace {

std::string typeOf(const json& j, const char* component, const std::string& where) {
  TORCH_CHECK(j.is_object(), "HfTokenizer: bad ", component, " in '", where, "': got ", j.dump().substr(0, 200),
              ", expected an object with a \"type\". The file is corrupt.");
  return string_field(j, "type", component, where);
}

[[noreturn]] void unsupported(const char* component, const std::string& type, const std::string& where,
                              const char* supported) {
  TORCH_CHECK(false, "HfTokenizer: unsupported ", component, " in '", where, "': got \"", type, "\", expected one of ",
              supported, ". NYI: dtp reads the tokenizer.json forms of Llama 2/3, Mistral and Qwen 2.5/3.");
  std::abort();  // unreachable: TORCH_CHECK(false) throws
}

// A single character field (Metaspace's replacement, Strip's content).
std::string charField(const json& j, const char* key, const char* component, const std::string& where) {
  const std::string s = string_field(j, key, component, where);
  TORCH_CHECK(!s.empty() && is_valid_utf8(s) && utf8_length(static_cast<unsigned char>(s[0])) == s.size(),
              "HfTokenizer: bad field in '", where, "': got ", component, ".", key, " = \"", s,
              "\", expected one character. The file is corrupt.");
  return s;
}

Pattern patternField(const json& j, const char* component, const std::string& where) {
  const json& p = field(j, "pattern", component, where);
  if (p.is_object() && p.contains("Regex")) return Pattern::regex(string_field(p, "Regex", component, where), where);
  if (p.is_object() && p.contains("String")) return Pattern::literal(string_field(p, "String", component, where));
  TORCH_CHECK(false, "HfTokenizer: bad pattern in '", where, "': got ", component, ".pattern = ",
              p.dump().substr(0, 200), ", expected {\"Regex\": ...} or {\"String\": ...}. The file is corrupt.");
  return Pattern::literal("");
}

// Each match of `pattern` replaced by `content` (NormalizedString::replace
// and the Replace decoder).
std::string replaceAll(const std::string& text, const Pattern& pattern, const std::string& content) {
  std::vector<Span> found;
  pattern.find_all(text, found);
  if (found.empty()) return text;
  std::string out;
  size_t at = 0;
  for (const auto& [start, end] : found) {
    out.append(text, at, start - at);
    out += content;
    at = end;
  }
  out.append(text, at, std::string::npos);
  return out;
}

// --- normalizers ---

class NormalizerSequence final : public Normalizer {
 public:
  explicit NormalizerSequence(std::vector<std::unique_ptr<Normalizer>> parts) : parts_(std::move(parts)) {}
  void normalize(std::string& text) const override {
    for (const auto& p : parts_) p->normalize(text);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

class UnicodeForm final : public Normalizer {
 public:
  UnicodeForm(NormalForm form, const std::string& where) : form_(form) {
    TORCH_CHECK(have_unicode_normalization(), "HfTokenizer: NYI: normalizer ", normal_form_name(form), " of '", where,
                "' without utf8proc: dtp was built without libutf8proc (Qwen's tokenizer.json uses NFC). Install "
                "libutf8proc-dev (and pkgconf) and rebuild dtp.");
  }
  void normalize(std::string& text) const override { text = hf::normalize(text, form_); }

 private:
  NormalForm form_;
};

class Prepend final : public Normalizer {
 public:
  explicit Prepend(std::string prefix) : prefix_(std::move(prefix)) {}
  void normalize(std::string& text) const override {
    if (!text.empty()) text.insert(0, prefix_);
  }

 private:
  std::string prefix_;
};

class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(Pattern pattern, std::string content) : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void normalize(std::string& text) const override { text = replaceAll(text, pattern_, content_); }

 private:
  Pattern pattern_;
  std::string content_;
};

// --- pre-tokenizers ---

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

Behavior behaviorOf(const std::string& name, const std::string& where) {
  if (name == "Removed") return Behavior::kRemoved;
  if (name == "Isolated") return Behavior::kIsolated;
  if (name == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return Behavior::kMergedWithNext;
  if (name == "Contiguous") return Behavior::kContiguous;
  TORCH_CHECK(false, "HfTokenizer: unsupported Split behavior in '", where, "': got \"", name, "\", expected one of "
              "Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous. The file is corrupt.");
  return Behavior::kIsolated;
}

struct Part {
  Span span;
  bool remove;
};

// NormalizedString::split: the (offsets, is_match) cover of the text, shaped
// by the behavior, step for step as Hugging Face folds it.
std::vector<Part> shapeSplits(const std::vector<std::pair<Span, bool>>& matches, Behavior behavior) {
  std::vector<Part> out;
  bool previous_match = false;
  switch (behavior) {
    case Behavior::kIsolated:
      for (const auto& [span, m] : matches) out.push_back({span, false});
      break;
    case Behavior::kRemoved:
      for (const auto& [span, m] : matches) out.push_back({span, m});
      break;
    case Behavior::kContiguous:
      for (const auto& [span, m] : matches) {
        if (m == previous_match && !out.empty()) {
          out.back().span.second = span.second;
        } else {
          out.push_back({span, false});
        }
        previous_match = m;
      }
      break;
    case Behavior::kMergedWithPrevious:
      for (const auto& [span, m] : matches) {
        if (m && !previous_match && !out.empty()) {
          out.back().span.second = span.second;
        } else {
          out.push_back({span, false});
        }
        previous_match = m;
      }
      break;
    case Behavior::kMergedWithNext:
      for (auto it = matches.rbegin(); it != matches.rend(); ++it) {
        const auto& [span, m] = *it;
        if (m && !previous_match && !out.empty()) {
          out.back().span.first = span.first;
        } else {
          out.push_back({span, false});
        }
        previous_match = m;
      }
      std::reverse(out.begin(), out.end());
      break;
  }
  return out;
}

// Splits every text piece at the matches of `pattern` (inverted: at what
// lies between them).
void splitPieces(std::vector<Piece>& pieces, const Pattern& pattern, Behavior behavior, bool invert) {
  std::vector<Piece> out;
  out.reserve(pieces.size() * 2);
  std::vector<Span> found;
  std::vector<std::pair<Span, bool>> cover;
  for (Piece& piece : pieces) {
    if (piece.token >= 0) {
      out.push_back(std::move(piece));
      continue;
    }
    found.clear();
    cover.clear();
    pattern.find_all(piece.text, found);
    size_t at = 0;
    for (const Span& m : found) {
      if (at != m.first) cover.push_back({{at, m.first}, invert});
      cover.push_back({m, !invert});
      at = m.second;
    }
    if (at != piece.text.size()) cover.push_back({{at, piece.text.size()}, invert});
    for (const Part& part : shapeSplits(cover, behavior)) {
      if (part.remove || part.span.first == part.span.second) continue;
      out.push_back({piece.text.substr(part.span.first, part.span.second - part.span.first),
                     piece.at_start && part.span.first == 0, -1});
    }
  }
  pieces = std::move(out);
}

class PreTokenizerSequence final : public PreTokenizer {
 public:
  explicit PreTokenizerSequence(std::vector<std::unique_ptr<PreTokenizer>> parts) : parts_(std::move(parts)) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    for (const auto& p : parts_) p->pre_tokenize(pieces);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> parts_;
};

class Split final : public PreTokenizer {
 public:
  Split(Pattern pattern, Behavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override { splitPieces(pieces, pattern_, behavior_, invert_); }

 private:
  Pattern pattern_;
  Behavior behavior_;
  bool invert_;
};

// GPT-2's byte alphabet: printable bytes stand for themselves, the others
// for U+0100 onwards in byte order.
const std::array<char32_t, 256>& byteAlphabet() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    const auto printable = [](int b) { return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE; };
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) t[static_cast<size_t>(b)] = printable(b) ? static_cast<char32_t>(b) : next++;
    return t;
  }();
  return table;
}

// The UTF-8 of each byte's stand-in, and the reverse map (code point -> byte,
// -1 for none; every stand-in is below U+0144).
struct ByteMaps {
  std::array<std::string, 256> encode;
  std::array<int, 0x144> decode;
  ByteMaps() {
    decode.fill(-1);
    for (int b = 0; b < 256; ++b) {
      const char32_t c = byteAlphabet()[static_cast<size_t>(b)];
      append_utf8(encode[static_cast<size_t>(b)], c);
      decode[c] = b;
    }
  }
};
const ByteMaps& byteMaps() {
  static const ByteMaps maps;
  return maps;
}

// The bytes a byte-level token stands for; false when a character is not of
// the alphabet (an added token such as "<|im_start|>" keeps its own bytes).
bool byteLevelBytes(const std::string& token, std::string& out) {
  const ByteMaps& maps = byteMaps();
  const size_t mark = out.size();
  for (size_t at = 0; at < token.size();) {
    const char32_t c = code_point_at(token, at);
    at += utf8_length(static_cast<unsigned char>(token[at]));
    if (c >= maps.decode.size() || maps.decode[c] < 0) {
      out.resize(mark);
      return false;
    }
    out.push_back(static_cast<char>(maps.decode[c]));
  }
  return true;
}

class ByteLevelPre final : public PreTokenizer {
 public:
  ByteLevelPre(bool add_prefix_space, bool use_regex, const std::string& where) : add_prefix_space_(add_prefix_space) {
    // GPT-2's pattern, which HF's ByteLevel applies when use_regex is set.
    if (use_regex) {
      regex_ = std::make_unique<Pattern>(Pattern::regex(
          R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)", where));
    }
  }
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    if (add_prefix_space_) {
      for (Piece& p : pieces) {
        if (p.token < 0 && !p.text.empty() && p.text[0] != ' ') p.text.insert(0, " ");
      }
    }
    if (regex_) splitPieces(pieces, *regex_, Behavior::kIsolated, /*invert=*/false);
    const ByteMaps& maps = byteMaps();
    for (Piece& p : pieces) {
      if (p.token >= 0) continue;
      std::string mapped;
      mapped.reserve(p.text.size() * 2);
      for (const char c : p.text) mapped += maps.encode[static_cast<unsigned char>(c)];
      p.text = std::move(mapped);
    }
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<Pattern> regex_;
};

enum class PrependScheme { kFirst, kNever, kAlways };

// Metaspace's fields, old ("add_prefix_space") and new ("prepend_scheme").
struct MetaspaceConfig {
  std::string replacement;
  PrependScheme scheme = PrependScheme::kAlways;
  bool split = true;
  MetaspaceConfig(const json& j, const std::string& where) {
    replacement = charField(j, "replacement", "Metaspace", where);
    if (j.contains("prepend_scheme") && !j.at("prepend_scheme").is_null()) {
      const std::string s = string_field(j, "prepend_scheme", "Metaspace", where);
      TORCH_CHECK(s == "first" || s == "never" || s == "always", "HfTokenizer: bad Metaspace in '", where,
                  "': got prepend_scheme \"", s, "\", expected first, never or always. The file is corrupt.");
      scheme = s == "first" ? PrependScheme::kFirst : s == "never" ? PrependScheme::kNever : PrependScheme::kAlways;
    }
    if (!bool_field(j, "add_prefix_space", true, "Metaspace", where)) {
      TORCH_CHECK(scheme == PrependScheme::kNever || !j.contains("prepend_scheme"), "HfTokenizer: bad Metaspace in '",
                  where, "': got add_prefix_space false with prepend_scheme ", j.at("prepend_scheme").dump(),
                  ", expected \"never\" (Hugging Face refuses the pair). The file is corrupt.");
      scheme = PrependScheme::kNever;
    }
    split = bool_field(j, "split", true, "Metaspace", where);
  }
};

class MetaspacePre final : public PreTokenizer {
 public:
  MetaspacePre(const json& j, const std::string& where)
      : config_(j, where), space_(Pattern::literal(" ")), marker_(Pattern::literal(config_.replacement)) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    for (Piece& p : pieces) {
      if (p.token >= 0) continue;
      p.text = replaceAll(p.text, space_, config_.replacement);
      const bool starts = p.text.compare(0, config_.replacement.size(), config_.replacement) == 0;
      if (!starts && (config_.scheme == PrependScheme::kAlways ||
                      (config_.scheme == PrependScheme::kFirst && p.at_start))) {
        p.text.insert(0, config_.replacement);
      }
    }
    if (config_.split) splitPieces(pieces, marker_, Behavior::kMergedWithNext, /*invert=*/false);
  }

 private:
  MetaspaceConfig config_;
  Pattern space_;
  Pattern marker_;
};

// --- decoders ---

class DecoderSequence final : public Decoder {
 public:
  explicit DecoderSequence(std::vector<std::unique_ptr<Decoder>> parts) : parts_(std::move(parts)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (const auto& p : parts_) p->decode_chain(tokens);
  }
  void stream(std::string& token) const override {
    for (const auto& p : parts_) p->stream(token);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> parts_;
};

class ByteLevelDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const std::string& t : tokens) {
      if (!byteLevelBytes(t, bytes)) bytes += t;
    }
    tokens.assign(1, to_valid_utf8(bytes));  // String::from_utf8_lossy
  }
  void stream(std::string& token) const override {
    std::string bytes;
    if (byteLevelBytes(token, bytes)) token = std::move(bytes);
  }
};

class ReplaceDecoder final : public Decoder {
 public:
  ReplaceDecoder(Pattern pattern, std::string content) : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::string& t : tokens) t = replaceAll(t, pattern_, content_);
  }
  void stream(std::string& token) const override { token = replaceAll(token, pattern_, content_); }

 private:
  Pattern pattern_;
  std::string content_;
};

// "<0xE2>" -> 0xE2, or -1.
int byteToken(const std::string& t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
  const auto hex = [](char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                                                                                         : -1;
  };
  const int hi = hex(t[3]), lo = hex(t[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

class ByteFallbackDecoder final : public Decoder {
 public:
  // A run of byte tokens becomes its text when valid UTF-8, else one U+FFFD
  // per byte (HF's rule, unlike from_utf8_lossy).
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    std::string run;
    size_t run_bytes = 0;
    const auto flush = [&] {
      if (run_bytes == 0) return;
      if (is_valid_utf8(run)) {
        out.push_back(run);
      } else {
        for (size_t i = 0; i < run_bytes; ++i) out.emplace_back("\xEF\xBF\xBD");
      }
      run.clear();
      run_bytes = 0;
    };
    for (std::string& t : tokens) {
      const int b = byteToken(t);
      if (b >= 0) {
        run.push_back(static_cast<char>(b));
        ++run_bytes;
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    tokens = std::move(out);
  }
  void stream(std::string& token) const override {
    const int b = byteToken(token);
    if (b >= 0) token.assign(1, static_cast<char>(b));
  }
};

class FuseDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const std::string& t : tokens) all += t;
    tokens.assign(1, std::move(all));
  }
  void stream(std::string&) const override {}
};

class StripDecoder final : public Decoder {
 public:
  StripDecoder(std::string content, size_t start, size_t stop)
      : content_(std::move(content)), start_(start), stop_(stop) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::string& t : tokens) {
      std::vector<size_t> starts;  // the byte offset of each character
      for (size_t at = 0; at < t.size(); at += utf8_length(static_cast<unsigned char>(t[at]))) starts.push_back(at);
      const auto isContent = [&](size_t i) { return t.compare(starts[i], content_.size(), content_) == 0; };
      size_t first = 0;
      for (size_t i = 0; i < std::min(start_, starts.size()) && isContent(i); ++i) first = i + 1;
      size_t last = starts.size();
      for (size_t i = 0; i < std::min(stop_, starts.size()) && isContent(starts.size() - i - 1); ++i) {
        last = starts.size() - i - 1;
      }
      const size_t from = first < starts.size() ? starts[first] : t.size();
      const size_t to = last < starts.size() ? starts[last] : t.size();
      t = from < to ? t.substr(from, to - from) : std::string();
    }
  }
  void stream(std::string&) const override {}  // positional: the caller's contract keeps the space

 private:
  std::string content_;
  size_t start_, stop_;
};

class MetaspaceDecoder final : public Decoder {
 public:
  MetaspaceDecoder(const json& j, const std::string& where) : config_(j, where) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      const bool drop = i == 0 && config_.scheme != PrependScheme::kNever;
      std::string out;
      const std::string& t = tokens[i];
      for (size_t at = 0; at < t.size();) {
        const size_t len = utf8_length(static_cast<unsigned char>(t[at]));
        if (t.compare(at, len, config_.replacement) == 0) {
          if (!drop) out.push_back(' ');
        } else {
          out.append(t, at, len);
        }
        at += len;
      }
      tokens[i] = std::move(out);
    }
  }
  void stream(std::string& token) const override {
    token = replaceAll(token, Pattern::literal(config_.replacement), " ");
  }

 private:
  MetaspaceConfig config_;
};

// --- post-processors ---

class ProcessorSequence final : public PostProcessor {
 public:
  explicit ProcessorSequence(std::vector<std::unique_ptr<PostProcessor>> parts) : parts_(std::move(parts)) {}
  void process(std::vector<int32_t>& ids) const override {
    for (const auto& p : parts_) p->process(ids);
  }
  std::vector<int32_t> prefix() const override {
    std::vector<int32_t> all;
    for (auto it = parts_.rbegin(); it != parts_.rend(); ++it) {
      const auto p = (*it)->prefix();
      all.insert(all.begin(), p.begin(), p.end());
    }
    return all;
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> parts_;
};

// ByteLevel's post-processing only trims offsets, which dtp does not keep.
class NoIds final : public PostProcessor {
 public:
  void process(std::vector<int32_t>&) const override {}
  std::vector<int32_t> prefix() const override { return {}; }
};

class Template final : public PostProcessor {
 public:
  Template(const json& j, const std::string& where) {
    const json& single = field(j, "single", "TemplateProcessing", where);
    const json& specials = field(j, "special_tokens", "TemplateProcessing", where);
    TORCH_CHECK(single.is_array(), "HfTokenizer: bad TemplateProcessing in '", where, "': got single = ",
                single.dump().substr(0, 200), ", expected a list. The file is corrupt.");
    bool seen_sequence = false;
    for (const json& piece : single) {
      if (piece.is_object() && piece.contains("Sequence")) {
        const std::string id = string_field(piece.at("Sequence"), "id", "TemplateProcessing.single", where);
        TORCH_CHECK(id == "A" && !seen_sequence, "HfTokenizer: bad TemplateProcessing in '", where,
                    "': got a single template with sequence ", id, ", expected one sequence A. The file is corrupt.");
        seen_sequence = true;
      } else if (piece.is_object() && piece.contains("SpecialToken")) {
        const std::string id = string_field(piece.at("SpecialToken"), "id", "TemplateProcessing.single", where);
        TORCH_CHECK(specials.is_object() && specials.contains(id), "HfTokenizer: bad TemplateProcessing in '", where,
                    "': got the special token '", id, "', which special_tokens lacks. The file is corrupt.");
        const json& ids = field(specials.at(id), "ids", "TemplateProcessing.special_tokens", where);
        TORCH_CHECK(ids.is_array(), "HfTokenizer: bad TemplateProcessing in '", where, "': got ids ",
                    ids.dump().substr(0, 100), " for '", id, "', expected a list. The file is corrupt.");
        auto& side = seen_sequence ? after_ : before_;
        for (const json& i : ids) side.push_back(i.get<int32_t>());
      } else {
        TORCH_CHECK(false, "HfTokenizer: bad TemplateProcessing in '", where, "': got ", piece.dump().substr(0, 200),
                    ", expected {\"SpecialToken\": ...} or {\"Sequence\": ...}. The file is corrupt.");
      }
    }
    TORCH_CHECK(seen_sequence, "HfTokenizer: bad TemplateProcessing in '", where,
                "': got a single template without the sequence A, expected one. The file is corrupt.");
  }
  void process(std::vector<int32_t>& ids) const override {
    ids.insert(ids.begin(), before_.begin(), before_.end());
    ids.insert(ids.end(), after_.begin(), after_.end());
  }
  std::vector<int32_t> prefix() const override { return before_; }

 private:
  std::vector<int32_t> before_, after_;
};

template <typename T, typename Make>
std::vector<std::unique_ptr<T>> parts(const json& j, const char* key, const char* component, const std::string& where,
                                      Make make) {
  const json& list = field(j, key, component, where);
  TORCH_CHECK(list.is_array(), "HfTokenizer: bad ", component, " Sequence in '", where, "': got ", key, " = ",
              list.dump().substr(0, 200), ", expected a list. The file is corrupt.");
  std::vector<std::unique_ptr<T>> out;
  for (const json& p : list) {
    auto made = make(p, where);
    if (made) out.push_back(std::move(made));
  }
  return out;
}

}  // namespace

char32_t byte_to_char(unsigned char b) { return byteAlphabet()[b]; }

std::unique_ptr<Normalizer> make_normalizer(const json& j, const std::string& where) {
  if (j.is_null()) return nullptr;
  const std::string type = typeOf(j, "normalizer", where);
  if (type == "Sequence") {
    return std::make_unique<NormalizerSequence>(parts<Normalizer>(j, "normalizers", "normalizer", where, make_normalizer));
  }
  if (type == "NFC") return std::make_unique<UnicodeForm>(NormalForm::kNFC, where);
  if (type == "NFD") return std::make_unique<UnicodeForm>(NormalForm::kNFD, where);
  if (type == "NFKC") return std::make_unique<UnicodeForm>(NormalForm::kNFKC, where);
  if (type == "NFKD") return std::make_unique<UnicodeForm>(NormalForm::kNFKD, where);
  if (type == "Prepend") return std::make_unique<Prepend>(string_field(j, "prepend", "Prepend", where));
  if (type == "Replace") {
    return std::make_unique<ReplaceNormalizer>(patternField(j, "Replace", where), string_field(j, "content", "Replace", where));
  }
  unsupported("normalizer", type, where, "Sequence, NFC, NFD, NFKC, NFKD, Prepend, Replace");
}

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& j, const std::string& where) {
  if (j.is_null()) return nullptr;
  const std::string type = typeOf(j, "pre_tokenizer", where);
  if (type == "Sequence") {
    return std::make_unique<PreTokenizerSequence>(
        parts<PreTokenizer>(j, "pretokenizers", "pre_tokenizer", where, make_pre_tokenizer));
  }
  if (type == "Split") {
    return std::make_unique<Split>(patternField(j, "Split", where),
                                   behaviorOf(string_field(j, "behavior", "Split", where), where),
                                   bool_field(j, "invert", false, "Split", where));
  }
  if (type == "ByteLevel") {
    return std::make_unique<ByteLevelPre>(bool_field(j, "add_prefix_space", true, "ByteLevel", where),
                                          bool_field(j, "use_regex", true, "ByteLevel", where), where);
  }
  if (type == "Metaspace") return std::make_unique<MetaspacePre>(j, where);
  unsupported("pre_tokenizer", type, where, "Sequence, Split, ByteLevel, Metaspace");
}

std::unique_ptr<Decoder> make_decoder(const json& j, const std::string& where) {
  if (j.is_null()) return nullptr;
  const std::string type = typeOf(j, "decoder", where);
  if (type == "Sequence") {
    return std::make_unique<DecoderSequence>(parts<Decoder>(j, "decoders", "decoder", where, make_decoder));
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "Replace") {
    return std::make_unique<ReplaceDecoder>(patternField(j, "Replace", where), string_field(j, "content", "Replace", where));
  }
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip") {
    const auto count = [&](const char* key) {
      const json& v = field(j, key, "Strip", where);
      TORCH_CHECK(v.is_number_unsigned(), "HfTokenizer: bad Strip in '", where, "': got ", key, " = ", v.dump(),
                  ", expected a count >= 0. The file is corrupt.");
      return v.get<size_t>();
    };
    return std::make_unique<StripDecoder>(charField(j, "content", "Strip", where), count("start"), count("stop"));
  }
  if (type == "Metaspace") return std::make_unique<MetaspaceDecoder>(j, where);
  unsupported("decoder", type, where, "Sequence, ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace");
}

std::unique_ptr<PostProcessor> make_post_processor(const json& j, const std::string& where) {
  if (j.is_null()) return nullptr;
  const std::string type = typeOf(j, "post_processor", where);
  if (type == "Sequence") {
    return std::make_unique<ProcessorSequence>(
        parts<PostProcessor>(j, "processors", "post_processor", where, make_post_processor));
  }
  if (type == "TemplateProcessing") return std::make_unique<Template>(j, where);
  if (type == "ByteLevel") return std::make_unique<NoIds>();
  unsupported("post_processor", type, where, "Sequence, TemplateProcessing, ByteLevel");
}

}  // namespace dtp::models::hf
