// The Unicode classes of tokenizer.json split patterns (\s, \p{L}, \p{N}):
// dtp matches the code points Hugging Face's tokenizers match (NOTE: [The
// reference's Unicode classes] in src/text/hf/regex.cpp), whatever the
// Unicode version of the PCRE2 it runs on.
//  - the table of differences is generated here: every code point where
//    PCRE2's own class disagrees with the reference's (unicode_classes.inc,
//    itself generated from the reference and checked against it by
//    run_reference.sh), and each entry is tested;
//  - the reference's table is checked against Debian's Unicode data
//    (unicode-data: UnicodeData.txt and PropList.txt, an older Unicode
//    version), on every code point that data assigns.
#include "text/hf/regex.h"
#include "text/hf/unicode_text.h"

#include <gtest/gtest.h>

#ifdef DTP_WITH_PCRE2
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#endif

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace dtp::models::hf {
namespace {

std::string utf8(char32_t c) {
  std::string s;
  append_utf8(s, c);
  return s;
}

std::string hex(char32_t c) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "U+%04X", static_cast<unsigned>(c));
  return buf;
}

bool isScalar(char32_t c) { return c < 0xD800 || (c > 0xDFFF && c < 0x110000); }

TEST(HfUnicodeClasses, ReferenceTablesAreAscendingDisjointRanges) {
  for (const CharClass c : kCharClasses) {
    char32_t next = 0;
    size_t count = 0;
    for (const CodePointRange& r : reference_ranges(c)) {
      EXPECT_LE(next, r.first) << char_class_name(c) << ": ranges overlap or are out of order at " << hex(r.first);
      EXPECT_LE(r.first, r.last) << char_class_name(c) << " at " << hex(r.first);
      EXPECT_TRUE(isScalar(r.first) && isScalar(r.last)) << char_class_name(c) << " at " << hex(r.first);
      next = r.last + 2;  // adjacent ranges would have been one
      count += r.last - r.first + 1;
    }
    EXPECT_GT(count, 0u) << char_class_name(c);
  }
  // Unicode 16.0 (Oniguruma 6.9.10 in the reference): U+180E left White_Space
  // in 6.3; U+2EBF0 (CJK Extension I) came in 15.1 and U+10D4A (Garay) in 16.0.
  EXPECT_FALSE(in_class(CharClass::kWhiteSpace, 0x180E));
  EXPECT_TRUE(in_class(CharClass::kWhiteSpace, 0x3000));
  EXPECT_TRUE(in_class(CharClass::kLetter, 0x2EBF0));
  EXPECT_TRUE(in_class(CharClass::kLetter, 0x10D4A));
  EXPECT_TRUE(in_class(CharClass::kNumber, 0x0663));  // ARABIC-INDIC DIGIT THREE
}

// Debian's unicode-data: the Unicode Character Database of its version (15.0
// in Debian 12, older than the reference's 16.0). The reference must agree
// with it on every code point it assigns (a class never changed for an
// assigned code point between the two); the code points it leaves
// unassigned are those of later versions.
#ifndef DTP_UNICODE_DATA_DIR
#define DTP_UNICODE_DATA_DIR "/usr/share/unicode"
#endif

TEST(HfUnicodeClasses, ReferenceAgreesWithDebiansUnicodeDataOnEveryCodePointItAssigns) {
  const std::string dir = DTP_UNICODE_DATA_DIR;
  std::ifstream data(dir + "/UnicodeData.txt"), props(dir + "/PropList.txt");
  if (!data || !props) GTEST_SKIP() << "no " << dir << "/UnicodeData.txt and PropList.txt: apt install unicode-data";
  // General categories; "First>"/"Last>" lines bound a range of one category.
  std::vector<std::string> category(0x110000, "Cn");
  std::string line;
  char32_t first = 0;
  while (std::getline(data, line)) {
    std::vector<std::string> f;
    std::stringstream ss(line);
    for (std::string x; std::getline(ss, x, ';');) f.push_back(x);
    ASSERT_GE(f.size(), 3u) << line;
    const auto cp = static_cast<char32_t>(std::stoul(f[0], nullptr, 16));
    if (f[1].find(", First>") != std::string::npos) {
      first = cp;
      continue;
    }
    const char32_t from = f[1].find(", Last>") != std::string::npos ? first : cp;
    for (char32_t c = from; c <= cp; ++c) category[c] = f[2];
  }
  std::vector<bool> white_space(0x110000);
  while (std::getline(props, line)) {
    if (line.find("; White_Space") == std::string::npos) continue;
    const size_t dots = line.find("..");
    const auto a = static_cast<char32_t>(std::stoul(line.substr(0, line.find_first_of(" .;")), nullptr, 16));
    const char32_t b = dots != std::string::npos && dots < line.find(';')
                           ? static_cast<char32_t>(std::stoul(line.substr(dots + 2), nullptr, 16))
                           : a;
    for (char32_t c = a; c <= b; ++c) white_space[c] = true;
  }
  std::map<std::string, int> newer;  // class -> code points unassigned in Debian's data
  int disagreements = 0;
  for (char32_t c = 0; c < 0x110000; ++c) {
    if (!isScalar(c)) continue;
    const std::string& gc = category[c];
    const bool assigned = gc != "Cn";
    const bool expected[] = {static_cast<bool>(white_space[c]), gc[0] == 'L', gc[0] == 'N'};
    for (const CharClass k : kCharClasses) {
      const bool reference = in_class(k, c);
      if (!assigned) {
        if (reference) ++newer[char_class_name(k)];
        continue;
      }
      if (reference != expected[static_cast<int>(k)] && ++disagreements <= 10) {
        ADD_FAILURE() << hex(c) << " (" << gc << ") is " << (reference ? "" : "not ") << char_class_name(k)
                      << " in the reference, " << (reference ? "not" : "but is") << " in " << dir;
      }
    }
  }
  EXPECT_EQ(disagreements, 0);
  // The reference is newer: Debian 12's 15.0 lacks 15.1's CJK Extension I.
  for (const auto& [name, n] : newer) std::printf("  %s: %d code points newer than %s\n", name.c_str(), n, dir.c_str());
}

#ifdef DTP_WITH_PCRE2

// PCRE2's own answer, the pattern compiled as written: does `escape` match
// the code point `c` alone?
class RawPcre2 {
 public:
  explicit RawPcre2(const std::string& escape) {
    int code = 0;
    PCRE2_SIZE offset = 0;
    const std::string anchored = "^" + escape + "$";
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(anchored.data()), anchored.size(), PCRE2_UTF | PCRE2_UCP,
                          &code, &offset, nullptr);
    EXPECT_NE(code_, nullptr) << escape;
    data_ = pcre2_match_data_create(1, nullptr);
  }
  ~RawPcre2() {
    pcre2_match_data_free(data_);
    pcre2_code_free(code_);
  }
  bool matches(char32_t c) const {
    const std::string s = utf8(c);
    return pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), 0, 0, data_, nullptr) >= 0;
  }

 private:
  pcre2_code* code_ = nullptr;
  pcre2_match_data* data_ = nullptr;
};

struct Difference {
  char32_t code_point;
  CharClass cls;
  bool reference;  // PCRE2 says the opposite
};

// The generated table: every code point whose \s, \p{L} or \p{N} differs
// between PCRE2 (as this machine has it) and the reference.
const std::vector<Difference>& differences() {
  static const std::vector<Difference> table = [] {
    std::vector<Difference> out;
    for (const CharClass k : kCharClasses) {
      const RawPcre2 raw(char_class_name(k));
      for (char32_t c = 0; c < 0x110000; ++c) {
        if (!isScalar(c)) continue;
        const bool reference = in_class(k, c);
        if (raw.matches(c) != reference) out.push_back({c, k, reference});
      }
    }
    return out;
  }();
  return table;
}

TEST(HfUnicodeClasses, PcreDiffersFromTheReferenceSomewhere) {
  std::map<std::string, int> count;
  for (const Difference& d : differences()) ++count[std::string(char_class_name(d.cls)) + (d.reference ? " +" : " -")];
  for (const auto& [what, n] : count) std::printf("  PCRE2 vs the reference: %s %d code points\n", what.c_str(), n);
  // PCRE2's \s is Perl's, which keeps U+180E on any Unicode version: the
  // table is never empty, and this test is never vacuous.
  bool has_180e = false;
  for (const Difference& d : differences()) has_180e |= d.code_point == 0x180E && d.cls == CharClass::kWhiteSpace;
  EXPECT_TRUE(has_180e) << "PCRE2's \\s no longer matches U+180E: check NOTE: [The reference's Unicode classes]";
}

TEST(HfUnicodeClasses, EveryDifferenceMatchesAsTheReferenceInEachFormOfTheClass) {
  // Each way a split pattern may name a class, alone or inside [...].
  struct Form {
    std::string pattern;
    CharClass cls;
    bool negated;
  };
  const std::vector<Form> forms = {
      {"\\s", CharClass::kWhiteSpace, false},   {"\\S", CharClass::kWhiteSpace, true},
      {"[\\s]", CharClass::kWhiteSpace, false}, {"[^\\s]", CharClass::kWhiteSpace, true},
      {"\\p{L}", CharClass::kLetter, false},    {"\\P{L}", CharClass::kLetter, true},
      {"\\pL", CharClass::kLetter, false},      {"\\p{^L}", CharClass::kLetter, true},
      {"[^\\p{L}]", CharClass::kLetter, true},  {"\\p{N}", CharClass::kNumber, false},
      {"\\P{N}", CharClass::kNumber, true},     {"[\\pN]", CharClass::kNumber, false},
      {"[^\\P{N}]", CharClass::kNumber, false},
  };
  std::vector<std::pair<Form, Pattern>> compiled;
  for (const Form& f : forms) compiled.emplace_back(f, Pattern::regex("^" + f.pattern + "$", "test"));
  // The classes of Llama 3's and Qwen's patterns, several items in one.
  const Pattern others = Pattern::regex("^[^\\s\\p{L}\\p{N}]$", "test");
  const Pattern prefix = Pattern::regex("^[^\\r\\n\\p{L}\\p{N}]$", "test");
  int failures = 0;
  for (const Difference& d : differences()) {
    const std::string s = utf8(d.code_point);
    for (const auto& [f, p] : compiled) {
      if (f.cls != d.cls) continue;
      const bool expected = d.reference != f.negated;
      if (p.contains(s) != expected && ++failures <= 10) {
        ADD_FAILURE() << "/" << f.pattern << "/ " << (expected ? "misses " : "matches ") << hex(d.code_point)
                      << ", which the reference " << (d.reference ? "has" : "lacks") << " in "
                      << char_class_name(d.cls);
      }
    }
    const bool ws = in_class(CharClass::kWhiteSpace, d.code_point), letter = in_class(CharClass::kLetter, d.code_point),
               number = in_class(CharClass::kNumber, d.code_point);
    EXPECT_EQ(others.contains(s), !(ws || letter || number)) << "[^\\s\\p{L}\\p{N}] at " << hex(d.code_point);
    EXPECT_EQ(prefix.contains(s), !(letter || number)) << "[^\\r\\n\\p{L}\\p{N}] at " << hex(d.code_point);
  }
  EXPECT_EQ(failures, 0) << "of " << differences().size() << " differences";
}

// The pieces of "x{c}1 {c}x" under Llama 3's (\p{N}{1,3}) and Qwen 2.5/3's
// (\p{N}) split patterns, by the reference's class of {c} (worked out from
// the patterns' alternatives in order).
std::vector<std::string> expectedPieces(const std::string& c, bool ws, bool letter, bool number, bool digit_runs) {
  if (letter) return {"x" + c, "1", " " + c + "x"};
  if (number && digit_runs) return {"x", c + "1", " ", c, "x"};
  if (number) return {"x", c, "1", " ", c, "x"};
  if (ws) return {"x", c, "1", " ", c + "x"};
  return {"x", c, "1", " " + c, "x"};
}

TEST(HfUnicodeClasses, Llama3AndQwenSplitEveryDifferenceAsTheReference) {
  const std::string llama3 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  const std::string qwen =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  int failures = 0;
  for (const auto& [name, source] : {std::make_pair("Llama 3", llama3), std::make_pair("Qwen", qwen)}) {
    const bool digit_runs = source == llama3;
    const Pattern p = Pattern::regex(source, "test");
    for (const Difference& d : differences()) {
      const char32_t c = d.code_point;
      if (c == '\r' || c == '\n') continue;  // no differences, and other pieces
      const std::string s = utf8(c), text = "x" + s + "1 " + s + "x";
      std::vector<Span> spans;
      p.find_all(text, spans);
      std::vector<std::string> pieces;
      for (const auto& [a, b] : spans) pieces.push_back(text.substr(a, b - a));
      const auto expected = expectedPieces(s, in_class(CharClass::kWhiteSpace, c), in_class(CharClass::kLetter, c),
                                           in_class(CharClass::kNumber, c), digit_runs);
      if (pieces != expected && ++failures <= 10) {
        ADD_FAILURE() << name << " splits the text around " << hex(c) << " into "
                      << ::testing::PrintToString(pieces) << ", expected " << ::testing::PrintToString(expected)
                      << " (the reference's " << char_class_name(d.cls) << ": " << (d.reference ? "yes" : "no")
                      << ")";
      }
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(HfUnicodeClasses, PatternsWithoutTheseClassesAreLeftAsWritten) {
  for (const std::string p : {"'s|'t", "\\p{Lu}+", "[\\x{41}-\\x{5A}]", "\\Q\\s\\E", "[[:alpha:]]", "\\\\s"}) {
    EXPECT_EQ(with_reference_classes(p), p);
  }
  // \Q...\E and an escaped backslash are literal text, not the class.
  EXPECT_TRUE(Pattern::regex("\\Q\\s\\E", "test").contains("\\s"));
  EXPECT_FALSE(Pattern::regex("\\Q\\s\\E", "test").contains(" "));
}

#endif  // DTP_WITH_PCRE2

}  // namespace
}  // namespace dtp::models::hf
