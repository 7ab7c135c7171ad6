// UTF-8 helpers for the Hugging Face tokenizer (hf_tokenizer.cpp): repair of
// invalid bytes, code points, and Unicode normalization forms.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dtp::models::hf {

// NOTE: [Invalid UTF-8 becomes U+FFFD]
// Hugging Face's `tokenizers` encodes Rust strings, which are valid UTF-8 by
// construction: its Python and Node bindings take str / JS strings, and a
// caller holding bytes decodes them first (Python's bytes.decode(errors=
// "replace"), Node's Buffer.toString("utf8"), WHATWG's TextDecoder). All three
// replace each maximal ill-formed subpart by one U+FFFD (Unicode's "U+FFFD
// substitution of maximal subparts", also Rust's String::from_utf8_lossy,
// which the ByteLevel decoder uses). dtp does the same before tokenizing, so
// "\xE2\x82 x" encodes as "\uFFFD x" (E2 82 is one subpart, one U+FFFD) and
// "\xFF\xFE" as two U+FFFD, exactly as the reference's string would.
std::string to_valid_utf8(std::string_view bytes);

// True when `bytes` is well-formed UTF-8 (no overlong forms, surrogates or
// code points above U+10FFFF).
bool is_valid_utf8(std::string_view bytes);

// The length in bytes of the UTF-8 sequence led by `lead` (1 for a byte that
// leads none). For text already made valid by to_valid_utf8.
inline size_t utf8_length(unsigned char lead) {
  return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
}

// The code point at `at` of valid UTF-8 text.
char32_t code_point_at(std::string_view text, size_t at);

void append_utf8(std::string& out, char32_t cp);

// The Unicode classes of split patterns as Hugging Face's tokenizers have
// them (Unicode 16.0 for the reference, tokenizers 0.23.2), from
// unicode_classes.inc, which tests/tokenizers/unicode_classes.mjs generates
// from the reference. See NOTE: [The reference's Unicode classes] in regex.cpp.
enum class CharClass { kWhiteSpace, kLetter, kNumber };  // \s (White_Space), \p{L}, \p{N}
constexpr CharClass kCharClasses[] = {CharClass::kWhiteSpace, CharClass::kLetter, CharClass::kNumber};
struct CodePointRange {
  char32_t first, last;  // inclusive
};
struct CodePointRanges {
  const CodePointRange* data;
  size_t size;
  const CodePointRange* begin() const { return data; }
  const CodePointRange* end() const { return data + size; }
};
// The code points of `c`, ascending ranges.
CodePointRanges reference_ranges(CharClass c);
// Whether `cp` is in `c` (a binary search of reference_ranges).
bool in_class(CharClass c, char32_t cp);
// "\s", "\p{L}", "\p{N}": for messages.
const char* char_class_name(CharClass c);

// Unicode normalization forms through utf8proc (Debian's libutf8proc).
enum class NormalForm { kNFC, kNFD, kNFKC, kNFKD };
const char* normal_form_name(NormalForm form);
// Whether dtp was built with utf8proc; without it normalize() throws.
bool have_unicode_normalization();
std::string normalize(std::string_view valid_utf8, NormalForm form);

}  // namespace dtp::models::hf
