#include "models/hf/regex.h"

#include "models/hf/unicode_text.h"

#include <c10/util/Exception.h>

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

}  // namespace

Pattern Pattern::regex(const std::string& pattern, const std::string& where) {
  int code = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* compiled = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                       PCRE2_UTF | PCRE2_UCP, &code, &offset, nullptr);
  TORCH_CHECK(compiled != nullptr, "HfTokenizer: bad regex in '", where, "': got /", pattern, "/, which PCRE2 refuses at ",
              "offset ", offset, ": ", pcre2Message(code), ". The file is corrupt or uses a syntax dtp does not know.");
  auto c = std::make_shared<Compiled>();
  c->code = compiled;
  c->jit = pcre2_jit_compile(compiled, PCRE2_JIT_COMPLETE) == 0;
  Pattern p;
  p.compiled_ = std::move(c);
  p.source_ = pattern;
  return p;
}

#else  // !DTP_WITH_PCRE2

struct Pattern::Compiled {};

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
