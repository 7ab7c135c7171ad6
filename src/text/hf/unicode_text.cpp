#include "text/hf/unicode_text.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <memory>

#ifdef DTP_WITH_UTF8PROC
#include <utf8proc.h>
#endif

namespace dtp::models::hf {
namespace {

// How many bytes of a well-formed sequence start at `at`, or, when it is
// ill-formed, the length of its maximal subpart as a negative number (at
// least 1 byte): Unicode's table 3-7 of well-formed byte sequences.
int sequenceAt(std::string_view s, size_t at) {
  const auto b = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char lead = b(at);
  if (lead < 0x80) return 1;
  int need = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    need = 1;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    need = 2;
    if (lead == 0xE0) lo = 0xA0;
    if (lead == 0xED) hi = 0x9F;  // no surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    need = 3;
    if (lead == 0xF0) lo = 0x90;
    if (lead == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return -1;  // a continuation byte, C0, C1 or F5..FF: never part of a sequence
  }
  for (int k = 1; k <= need; ++k) {
    if (at + k >= s.size()) return -k;
    const unsigned char c = b(at + k);
    const bool ok = k == 1 ? (c >= lo && c <= hi) : (c >= 0x80 && c <= 0xBF);
    if (!ok) return -k;
  }
  return need + 1;
}

}  // namespace

std::string to_valid_utf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t at = 0; at < bytes.size();) {
    const int n = sequenceAt(bytes, at);
    if (n > 0) {
      out.append(bytes.data() + at, static_cast<size_t>(n));
      at += static_cast<size_t>(n);
    } else {
      out.append("\xEF\xBF\xBD");  // U+FFFD for the maximal subpart
      at += static_cast<size_t>(-n);
    }
  }
  return out;
}

bool is_valid_utf8(std::string_view bytes) {
  for (size_t at = 0; at < bytes.size();) {
    const int n = sequenceAt(bytes, at);
    if (n < 0) return false;
    at += static_cast<size_t>(n);
  }
  return true;
}

char32_t code_point_at(std::string_view text, size_t at) {
  const auto b = [&](size_t i) { return static_cast<char32_t>(static_cast<unsigned char>(text[i])); };
  const char32_t lead = b(at);
  if (lead < 0x80) return lead;
  if (lead < 0xE0) return ((lead & 0x1F) << 6) | (b(at + 1) & 0x3F);
  if (lead < 0xF0) return ((lead & 0x0F) << 12) | ((b(at + 1) & 0x3F) << 6) | (b(at + 2) & 0x3F);
  return ((lead & 0x07) << 18) | ((b(at + 1) & 0x3F) << 12) | ((b(at + 2) & 0x3F) << 6) | (b(at + 3) & 0x3F);
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

namespace {
#include "text/hf/unicode_classes.inc"
}  // namespace

CodePointRanges reference_ranges(CharClass c) {
  switch (c) {
    case CharClass::kWhiteSpace: return {kWhiteSpaceRanges, std::size(kWhiteSpaceRanges)};
    case CharClass::kLetter: return {kLetterRanges, std::size(kLetterRanges)};
    case CharClass::kNumber: return {kNumberRanges, std::size(kNumberRanges)};
  }
  TORCH_INTERNAL_ASSERT(false, "unknown CharClass ", static_cast<int>(c));
  return {nullptr, 0};
}

bool in_class(CharClass c, char32_t cp) {
  const CodePointRanges r = reference_ranges(c);
  // The first range whose last code point is >= cp.
  const CodePointRange* it =
      std::lower_bound(r.begin(), r.end(), cp, [](const CodePointRange& x, char32_t v) { return x.last < v; });
  return it != r.end() && it->first <= cp;
}

const char* char_class_name(CharClass c) {
  switch (c) {
    case CharClass::kWhiteSpace: return "\\s";
    case CharClass::kLetter: return "\\p{L}";
    case CharClass::kNumber: return "\\p{N}";
  }
  return "?";
}

const char* normal_form_name(NormalForm form) {
  switch (form) {
    case NormalForm::kNFC: return "NFC";
    case NormalForm::kNFD: return "NFD";
    case NormalForm::kNFKC: return "NFKC";
    case NormalForm::kNFKD: return "NFKD";
  }
  return "?";
}

bool have_unicode_normalization() {
#ifdef DTP_WITH_UTF8PROC
  return true;
#else
  return false;
#endif
}

std::string normalize(std::string_view valid_utf8, NormalForm form) {
#ifdef DTP_WITH_UTF8PROC
  if (valid_utf8.empty()) return {};
  // All-ASCII text is in every normal form.
  bool ascii = true;
  for (const char c : valid_utf8) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
  if (ascii) return std::string(valid_utf8);
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNFC: options |= UTF8PROC_COMPOSE; break;
    case NormalForm::kNFD: options |= UTF8PROC_DECOMPOSE; break;
    case NormalForm::kNFKC: options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
    case NormalForm::kNFKD: options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
  }
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(valid_utf8.data()),
                                          static_cast<utf8proc_ssize_t>(valid_utf8.size()), &out,
                                          static_cast<utf8proc_option_t>(options));
  TORCH_CHECK(n >= 0, "HfTokenizer: Unicode ", normal_form_name(form), " failed: got \"", utf8proc_errmsg(n),
              "\" on ", valid_utf8.size(), " bytes, expected valid UTF-8.");
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(out, &std::free);
  return std::string(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
#else
  TORCH_CHECK(false, "HfTokenizer: NYI: Unicode ", normal_form_name(form), " without utf8proc: dtp was built without "
              "libutf8proc. Install libutf8proc-dev (and pkgconf) and rebuild dtp.");
  return {};
#endif
}

}  // namespace dtp::models::hf
