#include "text/hf/regex.h"

#include "text/hf/unicode_text.h"

#include <c10/util/Exception.h>

#include <cctype>
#include <cstdio>
#include <cstring>
#include <optional>

#ifdef DTP_WITH_PCRE2
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#endif

namespace dtp::models::hf {

bool have_pcre2() {
#ifdef DTP_WITH_PCRE2
  return true;
#else
  return false;
#endif
}

#ifdef DTP_WITH_PCRE2

struct Pattern::Compiled {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Compiled() { pcre2_code_free(code); }
};

namespace {

// Per thread, shared by every pattern: one ovector pair is all a split needs
// (PCRE2 still reports the whole match when captures do not fit), and a JIT
// stack larger than the default 32 KiB, which `\s+(?!\S)` over a long run of
// spaces can exhaust.
struct MatchScratch {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
  MatchScratch() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~MatchScratch() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

MatchScratch& scratch() {
  thread_local MatchScratch s;
  return s;
}

std::string pcre2Message(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof(buffer));
  return reinterpret_cast<const char*>(buffer);
}

// The next match at or after `from`, or false. PCRE2_NO_UTF_CHECK: the text
// was made valid UTF-8 first (NOTE: [Invalid UTF-8 becomes U+FFFD]).
bool nextMatch(const pcre2_code* code, bool jit, std::string_view text, size_t from, Span& found,
               const std::string& source) {
  MatchScratch& s = scratch();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const int rc = jit ? pcre2_jit_match(code, subject, text.size(), from, PCRE2_NO_UTF_CHECK, s.data, s.context)
                     : pcre2_match(code, subject, text.size(), from, PCRE2_NO_UTF_CHECK, s.data, s.context);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  TORCH_CHECK(rc >= 0, "HfTokenizer: the split pattern failed: got PCRE2 error \"", pcre2Message(rc), "\" for /",
              source, "/ on a text of ", text.size(), " bytes, expected a match or none.");
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(s.data);
  found = {ov[0], ov[1]};
  return true;
}

// NOTE: [The reference's Unicode classes]
// Hugging Face's tokenizers run split patterns through Oniguruma (the onig
// crate), with the Unicode tables of its own version: 16.0 in the reference,
// tokenizers 0.23.2 (measured on every code point by
// tests/tokenizers/unicode_classes.mjs). PCRE2 has those of its version: 14.0
// in Debian 12's 10.42, 16.0 in Debian 13's 10.45. And PCRE2's \s is Perl's
// (the Z categories, \h and \v), which keeps U+180E MONGOLIAN VOWEL SEPARATOR
// (a space until Unicode 6.3, Cf since), where Oniguruma's \s is White_Space.
// So the classes of split patterns, \s \S \p{L} \P{L} \p{N} \P{N} (also
// written \pL, \p{^L}, ...), alone or inside [...], are rewritten before
// compiling to mean the reference's code points (unicode_classes.inc):
//  - PCRE2's own code points of each class are read once per process (one
//    match over a text of every code point: 74 ms here, on the first
//    pattern that names a class) and compared with the reference's: `added`
//    are the code points only the reference has, `removed` those only PCRE2
//    has;
//  - an item of a class with neither stays as written (Debian 13's \p{L});
//  - \p{X} with nothing removed becomes \p{X} and the added ranges (Debian
//    12: \p{L} gains 9272 letters of Unicode 15.0..16.0, in 35 ranges), \P{X}
//    with nothing added becomes \P{X} and the removed ranges (Debian 12: \S
//    gains U+180E);
//  - any other item becomes the reference's ranges written out (Debian 12:
//    \s, 10 ranges), or their complement for \P{X}.
// Outside [...] the result is bracketed: \s -> [\x{9}-\x{D}\x{20}...]. Each
// item then matches exactly the reference's set, so a class of several
// items, negated or not ([^\s\p{L}\p{N}]), does too. PCRE2's property stays
// where it is right because it is fast: \p{L} as 677 explicit ranges made
// CJK text 16x slower to split. Other properties (\w, \d, \p{Lu}, ...) keep
// PCRE2's tables: the split patterns of GPT-2, Llama 3 and Qwen 2.5/3 use
// none of them.
struct ClassDifference {
  std::vector<CodePointRange> added, removed;
};

// Every Unicode scalar value, in order, as UTF-8.
std::string everyCodePoint() {
  std::string text;
  text.reserve(4 * 0x110000);
  for (char32_t c = 0; c < 0x110000; ++c) {
    if (c < 0xD800 || c > 0xDFFF) append_utf8(text, c);
  }
  return text;
}

std::vector<CodePointRange> toRanges(const std::vector<bool>& in) {
  std::vector<CodePointRange> out;
  for (char32_t c = 0; c < in.size(); ++c) {
    if (!in[c]) continue;
    if (!out.empty() && out.back().last + 1 == c) {
      out.back().last = c;
    } else {
      out.push_back({c, c});
    }
  }
  return out;
}

// PCRE2's code points of each class against the reference's.
std::vector<ClassDifference> pcre2Differences() {
  const std::string text = everyCodePoint();
  std::vector<ClassDifference> out;
  for (const CharClass c : kCharClasses) {
    const std::string pattern = std::string(char_class_name(c)) + "+";
    int code = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code* compiled = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                         PCRE2_UTF | PCRE2_UCP, &code, &offset, nullptr);
    TORCH_INTERNAL_ASSERT(compiled != nullptr, "PCRE2 refuses /", pattern, "/: ", pcre2Message(code));
    const bool jit = pcre2_jit_compile(compiled, PCRE2_JIT_COMPLETE) == 0;
    std::vector<bool> pcre2(0x110000), reference(0x110000);
    Span m;
    for (size_t from = 0; from < text.size() && nextMatch(compiled, jit, text, from, m, pattern); from = m.second) {
      for (size_t at = m.first; at < m.second; at += utf8_length(static_cast<unsigned char>(text[at]))) {
        pcre2[code_point_at(text, at)] = true;
      }
    }
    pcre2_code_free(compiled);
    for (const CodePointRange& r : reference_ranges(c)) {
      for (char32_t cp = r.first; cp <= r.last; ++cp) reference[cp] = true;
    }
    std::vector<bool> added(0x110000), removed(0x110000);
    for (size_t cp = 0; cp < 0x110000; ++cp) {
      added[cp] = reference[cp] && !pcre2[cp];
      removed[cp] = pcre2[cp] && !reference[cp];
    }
    out.push_back({toRanges(added), toRanges(removed)});
  }
  return out;
}

const ClassDifference& differenceOf(CharClass c) {
  static const std::vector<ClassDifference> differences = pcre2Differences();
  return differences[static_cast<size_t>(c)];
}

// "\x{9}-\x{D}\x{20}": ranges as the items of a PCRE2 class.
std::string classItems(const std::vector<CodePointRange>& ranges) {
  std::string out;
  char buf[32];
  for (const CodePointRange& r : ranges) {
    std::snprintf(buf, sizeof(buf), "\\x{%X}", static_cast<unsigned>(r.first));
    out += buf;
    if (r.last == r.first) continue;
    std::snprintf(buf, sizeof(buf), "-\\x{%X}", static_cast<unsigned>(r.last));
    out += buf;
  }
  return out;
}

// The scalar values outside `ranges` (surrogates are no code points of a
// UTF-8 text).
std::vector<CodePointRange> complementOf(CodePointRanges ranges) {
  std::vector<CodePointRange> out;
  char32_t next = 0;
  const auto addUpTo = [&](char32_t end) {  // [next, end)
    if (next < 0xD800 && end > 0xD800) {
      out.push_back({next, 0xD7FF});
      next = 0xE000;
    }
    if (next < end) out.push_back({next, end - 1});
  };
  for (const CodePointRange& r : ranges) {
    addUpTo(r.first);
    next = r.last + 1;
  }
  addUpTo(0x110000);
  return out;
}

// The class an escape names: \s, \S, \p{L}, \pN, \P{^L}, ... (PCRE2 compares
// property names loosely: case, spaces, '-' and '_' aside).
std::optional<std::pair<CharClass, bool>> classOf(const std::string& escape) {
  if (escape == "\\s") return std::make_pair(CharClass::kWhiteSpace, false);
  if (escape == "\\S") return std::make_pair(CharClass::kWhiteSpace, true);
  if (escape.size() < 3 || (escape[1] != 'p' && escape[1] != 'P')) return std::nullopt;
  bool negated = escape[1] == 'P';
  std::string name;
  for (size_t i = 2; i < escape.size(); ++i) {
    const char c = escape[i];
    if (c == '{' || c == '}' || c == ' ' || c == '-' || c == '_') continue;
    if (c == '^' && i == 3) {
      negated = !negated;
      continue;
    }
    name += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  if (name == "l") return std::make_pair(CharClass::kLetter, negated);
  if (name == "n") return std::make_pair(CharClass::kNumber, negated);
  return std::nullopt;
}

// An escape of `c` as the items of a class that match the reference's code
// points (NOTE: [The reference's Unicode classes]).
std::string referenceItems(const std::string& escape, CharClass c, bool negated) {
  const ClassDifference& d = differenceOf(c);
  if (d.added.empty() && d.removed.empty()) return escape;
  if (!negated && d.removed.empty()) return escape + classItems(d.added);
  if (negated && d.added.empty()) return escape + classItems(d.removed);
  const CodePointRanges reference = reference_ranges(c);
  return classItems(negated ? complementOf(reference) : std::vector<CodePointRange>(reference.begin(), reference.end()));
}

// Length of the escape at `at` (a backslash): \x{...} and the like to their
// brace, \pL three characters, others two.
size_t escapeLength(const std::string& p, size_t at) {
  if (at + 1 >= p.size()) return 1;
  const char e = p[at + 1];
  if (at + 2 < p.size() && p[at + 2] == '{' && std::strchr("xopPNgk", e) != nullptr) {
    const size_t close = p.find('}', at + 3);
    return close == std::string::npos ? p.size() - at : close + 1 - at;
  }
  if ((e == 'p' || e == 'P') && at + 2 < p.size()) return 3;
  return 2;
}

// `pattern` with its classes rewritten to the reference's code points (NOTE:
// [The reference's Unicode classes]).
std::string withReferenceClasses(const std::string& p) {
  std::string out;
  out.reserve(p.size());
  bool in_class = false;
  for (size_t i = 0; i < p.size();) {
    if (p[i] == '\\') {
      if (p.compare(i, 2, "\\Q") == 0) {  // a literal up to \E
        const size_t end = p.find("\\E", i + 2);
        const size_t stop = end == std::string::npos ? p.size() : end + 2;
        out.append(p, i, stop - i);
        i = stop;
        continue;
      }
      const std::string escape = p.substr(i, escapeLength(p, i));
      i += escape.size();
      const auto cls = classOf(escape);
      if (!cls) {
        out += escape;
        continue;
      }
      const std::string items = referenceItems(escape, cls->first, cls->second);
      out += in_class || items == escape ? items : "[" + items + "]";
      continue;
    }
    if (!in_class && p[i] == '[') {
      in_class = true;
      out += p[i++];
      if (i < p.size() && p[i] == '^') out += p[i++];
      if (i < p.size() && p[i] == ']') out += p[i++];  // a first ']' is literal
      continue;
    }
    if (in_class && p.compare(i, 2, "[:") == 0) {  // [:alpha:]
      const size_t end = p.find(":]", i + 2);
      const size_t stop = end == std::string::npos ? i + 1 : end + 2;
      out.append(p, i, stop - i);
      i = stop;
      continue;
    }
    if (in_class && p[i] == ']') in_class = false;
    out += p[i++];
  }
  return out;
}

}  // namespace

std::string with_reference_classes(const std::string& pattern) { return withReferenceClasses(pattern); }

Pattern Pattern::regex(const std::string& source, const std::string& where) {
  // See NOTE: [The reference's Unicode classes]
  const std::string pattern = withReferenceClasses(source);
  int code = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* compiled = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                       PCRE2_UTF | PCRE2_UCP, &code, &offset, nullptr);
  TORCH_CHECK(compiled != nullptr, "HfTokenizer: bad regex in '", where, "': got /", source, "/, which PCRE2 refuses",
              pattern == source ? "" : " (its Unicode classes written out)", " at offset ", offset, ": ",
              pcre2Message(code), ". The file is corrupt or uses a syntax dtp does not know.");
  auto c = std::make_shared<Compiled>();
  c->code = compiled;
  c->jit = pcre2_jit_compile(compiled, PCRE2_JIT_COMPLETE) == 0;
  Pattern p;
  p.compiled_ = std::move(c);
  p.source_ = source;
  return p;
}

#else  // !DTP_WITH_PCRE2

struct Pattern::Compiled {};

std::string with_reference_classes(const std::string& pattern) { return pattern; }

Pattern Pattern::regex(const std::string& pattern, const std::string& where) {
  TORCH_CHECK(false, "HfTokenizer: NYI: the regex /", pattern, "/ of '", where, "' without PCRE2: dtp was built "
              "without libpcre2-8, which tokenizer.json split patterns need (Llama 3, Qwen). Install libpcre2-dev "
              "(and pkgconf) and rebuild dtp.");
  return {};
}

#endif

Pattern Pattern::literal(const std::string& text) {
  Pattern p;
  p.source_ = text;
  return p;
}

void Pattern::find_all(std::string_view text, std::vector<Span>& out) const {
  if (!compiled_) {
    // An empty literal matches nothing, as in Hugging Face's Pattern for &str.
    if (source_.empty()) return;
    for (size_t at = text.find(source_); at != std::string_view::npos; at = text.find(source_, at + source_.size())) {
      out.emplace_back(at, at + source_.size());
    }
    return;
  }
#ifdef DTP_WITH_PCRE2
  Span m;
  for (size_t from = 0; from <= text.size() && nextMatch(compiled_->code, compiled_->jit, text, from, m, source_);) {
    if (m.second == m.first) {  // an empty match splits nothing: step over one character
      from = m.first + (m.first < text.size() ? utf8_length(static_cast<unsigned char>(text[m.first])) : 1);
      continue;
    }
    out.push_back(m);
    from = m.second;
  }
#endif
}

bool Pattern::contains(std::string_view text) const {
  std::vector<Span> found;
  find_all(text, found);
  return !found.empty();
}

}  // namespace dtp::models::hf
