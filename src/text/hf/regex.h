// The split and replace patterns of tokenizer.json: a regex through PCRE2
// (Debian's libpcre2-8, UTF and Unicode properties, JIT where the platform has
// it) or a literal string.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtp::models::hf {

using Span = std::pair<size_t, size_t>;  // [start, end) byte offsets

// Whether dtp was built with PCRE2; without it a Regex pattern is an error.
bool have_pcre2();

// `pattern` with \s, \p{L} and \p{N} (and their negations) rewritten to
// match the code points Hugging Face's tokenizers match, whatever PCRE2's
// Unicode version (NOTE: [The reference's Unicode classes] in regex.cpp).
// Pattern::regex compiles this; without PCRE2 it is `pattern`.
std::string with_reference_classes(const std::string& pattern);

// A tokenizer.json pattern: {"Regex": "..."} or {"String": "..."}.
class Pattern {
 public:
  // Hugging Face compiles {"Regex"} with Oniguruma (Perl-like syntax and
  // leftmost-first alternation, as PCRE2's): the patterns of real files
  // ((?i:'s|...), \p{L}, \p{N}, \s+(?!\S)) mean the same in both, once
  // their Unicode classes are the reference's (with_reference_classes).
  // `where` names the file, for errors.
  static Pattern regex(const std::string& pattern, const std::string& where);
  static Pattern literal(const std::string& text);

  // The non-overlapping, non-empty matches in valid UTF-8 `text`, left to
  // right, appended to `out`.
  void find_all(std::string_view text, std::vector<Span>& out) const;

  // Whether the pattern matches in `text` at all.
  bool contains(std::string_view text) const;

  const std::string& source() const { return source_; }

 private:
  struct Compiled;
  std::shared_ptr<const Compiled> compiled_;  // null for a literal
  std::string source_;
};

}  // namespace dtp::models::hf
