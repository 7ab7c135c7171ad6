// UTF-8 helpers for the Hugging Face tokenizer (hf_tokenizer.cpp): repair of
// invalid bytes, code points, and Unicode normalization forms.
#pragma once

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

// Unicode normalization forms through utf8proc (Debian's libutf8proc).
enum class NormalForm { kNFC, kNFD, kNFKC, kNFKD };
const char* normal_form_name(NormalForm form);
// Whether dtp was built with utf8proc; without it normalize() throws.
bool have_unicode_normalization();
std::string normalize(std::string_view valid_utf8, NormalForm form);

}  // namespace dtp::models::hf
