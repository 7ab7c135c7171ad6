// Chat templates by family. NOTE: [Chat templates by marker]
// A chat_template is Jinja, and no C++ Jinja engine is packaged in Debian.
// The templates of the models dtp runs differ only in a few literals, so dtp
// recognises a family by the special tokens its template writes and reads the
// literals that vary (a default system prompt, a space before [/INST]) from
// the template's text. Everything else is refused by name rather than
// guessed: the families' output is compared with Hugging Face's Jinja
// rendering (@huggingface/transformers) in tests/tokenizers/.
#include "dtp/text/chat.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

namespace dtp::models {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kFamilies =
    "Llama 3's header format (<|start_header_id|> ... <|eot_id|>; Llama 3.1 / 3.2 / 3.3 with their dated system "
    "header), ChatML (<|im_start|> ... <|im_end|>: Qwen 2.5, Qwen 3), Mistral's [INST] ... [/INST] or Llama 2 chat's "
    "[INST] <<SYS>>";

bool has(const std::string& text, const char* marker) { return text.find(marker) != std::string::npos; }

json readJson(const fs::path& path, const char* component) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), component, ": cannot read '", path.string(), "': got a missing or unreadable file, expected ",
              "a JSON file. Check the model folder.");
  try {
    return json::parse(in);
  } catch (const json::parse_error& e) {
    TORCH_CHECK(false, component, ": bad JSON in '", path.string(), "': got \"", e.what(), "\", expected a complete "
                "JSON file. The file is truncated or corrupt: download it again.");
  }
  return {};
}

std::string tokenText(const json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j.at("content").is_string()) return j.at("content").get<std::string>();
  return "";
}

// A Jinja string literal's escapes (\n, \', \\ ...).
std::string unescapeJinja(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 == s.size()) {
      out.push_back(s[i]);
      continue;
    }
    const char c = s[++i];
    out.push_back(c == 'n' ? '\n' : c == 't' ? '\t' : c == 'r' ? '\r' : c);
  }
  return out;
}

// Qwen 2.5's default system prompt: the literal '<|im_start|>system\n...
// <|im_end|>\n' that its template writes when messages[0] is not a system
// message; a literal is one string with no quote or expression inside.
std::optional<std::string> defaultSystem(const std::string& text) {
  const std::string open = "<|im_start|>system\\n";
  for (size_t at = text.find(open); at != std::string::npos; at = text.find(open, at + 1)) {
    if (at == 0 || (text[at - 1] != '\'' && text[at - 1] != '"')) continue;
    const char quote = text[at - 1];
    const size_t body = at + open.size();
    const size_t close = text.find("<|im_end|>", body);
    if (close == std::string::npos) continue;
    const std::string literal = text.substr(body, close - body);
    if (literal.find(quote) != std::string::npos || has(literal, "{{") || has(literal, "{%")) continue;
    return unescapeJinja(literal);
  }
  return std::nullopt;
}

// Jinja's trim (Python's str.strip, JavaScript's trim): Unicode white space.
std::string trim(const std::string& s) {
  const auto space = [](const std::string& t, size_t at, size_t& len) {
    static const char* const kSpaces[] = {" ", "\t", "\n", "\v", "\f", "\r", "\xC2\xA0", "\xE3\x80\x80",
                                          "\xE2\x80\xA8", "\xE2\x80\xA9", "\xEF\xBB\xBF"};
    for (const char* sp : kSpaces) {
      const size_t n = std::char_traits<char>::length(sp);
      if (t.compare(at, n, sp) == 0) {
        len = n;
        return true;
      }
    }
    return false;
  };
  size_t begin = 0, len = 0;
  while (begin < s.size() && space(s, begin, len)) begin += len;
  size_t end = s.size();
  for (bool more = true; more && end > begin;) {
    more = false;
    for (size_t n = 1; n <= 3 && n <= end - begin; ++n) {
      if (space(s, end - n, len) && len == n) {
        end -= n;
        more = true;
        break;
      }
    }
  }
  return s.substr(begin, end - begin);
}

constexpr const char* kUsePrompt = "NYI: pass --prompt with the formatted text instead";

// The first capture of `re` in `text`, if it matches.
std::optional<std::string> capture(const std::string& text, const char* re) {
  std::smatch m;
  if (!std::regex_search(text, m, std::regex(re))) return std::nullopt;
  return m[1].str();
}

// strftime for the directives Llama 3.2's strftime_now("%d %b %Y") and
// @huggingface/jinja's strftime know (%Y %m %d %b %B %H %M %%), with English
// month names as Python's C locale writes them.
std::string strftimeC(const std::tm& tm, const std::string& format) {
  static const char* const kMonths[] = {"January", "February", "March",     "April",   "May",      "June",
                                        "July",    "August",   "September", "October", "November", "December"};
  const auto pad2 = [](int n) { return (n < 10 ? "0" : "") + std::to_string(n); };
  std::string out;
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] != '%' || i + 1 == format.size()) {
      out.push_back(format[i]);
      continue;
    }
    switch (const char c = format[++i]) {
      case 'Y': out += std::to_string(tm.tm_year + 1900); break;
      case 'm': out += pad2(tm.tm_mon + 1); break;
      case 'd': out += pad2(tm.tm_mday); break;
      case 'b': out += std::string(kMonths[tm.tm_mon]).substr(0, 3); break;
      case 'B': out += kMonths[tm.tm_mon]; break;
      case 'H': out += pad2(tm.tm_hour); break;
      case 'M': out += pad2(tm.tm_min); break;
      case '%': out.push_back('%'); break;
      default: out += std::string("%") + c;
    }
  }
  return out;
}

void refuseUnless(bool ok, const std::string& source, const char* got, const char* remedy) {
  TORCH_CHECK(ok, "ChatTemplate: unsupported chat template in '", source, "': got ", got, ", expected ", kFamilies,
              ". ", remedy);
}

// Llama 3.1 / 3.2 / 3.3 Instruct: the dated system block, read from the
// template's literals. With no tools the template renders
//   bos <|start_header_id|>system<|end_header_id|>\n\n
//   Cutting Knowledge Date: December 2023\nToday Date: {date_string}\n\n
//   {messages[0].content|trim if system else ""}<|eot_id|> {turns} {generation prompt}
// Each marker of that path is required, so that a variant is refused rather
// than rendered wrongly.
struct DatedHeader {
  std::string knowledge_line;
  std::string fallback_date;
  std::optional<std::string> today_format;
};

DatedHeader datedHeader(const std::string& text, const std::string& source) {
  refuseUnless(!has(text, "<|image|>"), source, "a Llama 3.2 Vision template (<|image|>)", "NYI: images");
  refuseUnless(!std::regex_search(text, std::regex(R"(if\s+system_message\b)")), source,
               "a dated Llama 3 template that writes its system block only for a system message", kUsePrompt);
  refuseUnless(!has(text, "tools") || std::regex_search(text, std::regex(R"(set\s+tools\s*=\s*none\b)")), source,
               "a dated Llama 3 template whose tools are not none by default", kUsePrompt);
  DatedHeader h;
  const auto knowledge = capture(text, R"raw(["'](Cutting Knowledge Date: [^"'\\]*\\n)["'])raw");
  refuseUnless(knowledge.has_value(), source, "a dated Llama 3 template without the literal \"Cutting Knowledge "
               "Date: ...\\n\"", kUsePrompt);
  h.knowledge_line = unescapeJinja(*knowledge);
  const std::regex today_line(R"raw(["']Today Date: ["']\s*\+\s*date_string\s*\+\s*["']\\n\\n["'])raw");
  refuseUnless(std::regex_search(text, today_line), source,
               "a dated Llama 3 template without \"Today Date: \" + date_string + \"\\n\\n\"", kUsePrompt);
  const auto fallback = capture(text, R"raw(set\s+date_string\s*=\s*["']([^"']*)["'])raw");
  refuseUnless(fallback.has_value(), source, "a dated Llama 3 template without a literal default for date_string "
               "(set date_string = \"26 Jul 2024\")", kUsePrompt);
  h.fallback_date = unescapeJinja(*fallback);
  if (has(text, "strftime_now")) {
    h.today_format = capture(text, R"raw(strftime_now\(\s*["']([^"']*)["']\s*\))raw");
    refuseUnless(h.today_format.has_value(), source, "a dated Llama 3 template calling strftime_now without a literal "
                 "format", kUsePrompt);
    const std::regex directive("%[^YmdbBHM%]|%$");
    refuseUnless(!std::regex_search(*h.today_format, directive), source, "a strftime_now format with directives "
                 "other than %Y %m %d %b %B %H %M %%", kUsePrompt);
  }
  refuseUnless(std::regex_search(text, std::regex(R"raw(set\s+system_message\s*=\s*(""|''))raw")) &&
                   std::regex_search(text, std::regex(R"raw(system_message\s*=\s*messages\[0\])raw"
                                                      R"raw(\[['"]content['"]\]\s*\|\s*trim)raw")) &&
                   std::regex_search(text, std::regex(R"(\{\{-?\s*system_message\s*-?\}\})")) &&
                   std::regex_search(text, std::regex(R"raw(["']<\|start_header_id\|>system<\|end_header_id\|>)raw"
                                                      R"raw(\\n\\n["'])raw")),
               source, "a dated Llama 3 template without Llama 3.1's system block (system_message = \"\" by default, "
               "messages[0]['content']|trim, {{- system_message }} after the system header)", kUsePrompt);
  return h;
}

// Qwen 3's earlier assistant turn: with a "</think>" in it, the reasoning is
// what lies between the last "<think>" and the first "</think>", the answer
// what follows the last "</think>":
//   "<think>\nplan\n</think>\n\n4" -> "4", or with `keep_reasoning` (a turn
//   after the last user query) "<think>\nplan\n</think>\n\n4".
std::string stripNewlines(std::string s, bool left, bool right) {
  if (right) s.erase(s.find_last_not_of('\n') + 1);
  if (left) s.erase(0, std::min(s.size(), s.find_first_not_of('\n')));
  return s;
}

std::string qwen3Assistant(const std::string& content, bool keep_reasoning) {
  const size_t close = content.rfind("</think>");
  if (close == std::string::npos) return content;
  const std::string answer = stripNewlines(content.substr(close + 8), /*left=*/true, /*right=*/false);
  std::string before = stripNewlines(content.substr(0, content.find("</think>")), /*left=*/false, /*right=*/true);
  const size_t open = before.rfind("<think>");
  if (open != std::string::npos) before = before.substr(open + 7);
  const std::string reasoning = stripNewlines(before, /*left=*/true, /*right=*/false);
  if (!keep_reasoning || reasoning.empty()) return answer;
  return "<think>\n" + stripNewlines(reasoning, true, true) + "\n</think>\n\n" + stripNewlines(answer, true, false);
}

// Llama 2 chat (meta-llama/Llama-2-*-chat-hf): the first user turn holds the
// system message, and the whole turn is stripped:
//   bos + '[INST] ' + ('<<SYS>>\n' + system + '\n<</SYS>>\n\n' + user).strip() + ' [/INST]'
void llama2Chat(const std::string& text, const std::string& source) {
  refuseUnless(!has(text, "DEFAULT_SYSTEM") && !has(text, "default_system") && !has(text, "USE_DEFAULT_PROMPT"),
               source, "Llama 2 chat's [INST] <<SYS>> template with a default system prompt", kUsePrompt);
  refuseUnless(has(text, "'<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content']") &&
                   has(text, "bos_token + '[INST] ' + content.strip() + ' [/INST]'") &&
                   has(text, "system_message = false"),
               source, "an [INST] <<SYS>> template other than Llama 2 chat's", kUsePrompt);
}

}  // namespace

ChatTemplate ChatTemplate::recognise(const std::string& text, const std::string& bos_token,
                                     const std::string& eos_token, const std::string& source) {
  ChatTemplate t;
  t.source_ = source;
  const bool writes_bos = has(text, "bos_token");
  if (has(text, "<|start_header_id|>") && has(text, "<|end_header_id|>") && has(text, "<|eot_id|>")) {
    t.family_ = Family::kLlama3;
    t.end_of_turn_ = "<|eot_id|>";
    t.trim_content_ = has(text, "| trim") || has(text, "|trim");
    if (has(text, "Cutting Knowledge Date") || has(text, "date_string")) {
      DatedHeader h = datedHeader(text, source);
      t.family_ = Family::kLlama3Dated;
      t.knowledge_line_ = std::move(h.knowledge_line);
      t.fallback_date_ = std::move(h.fallback_date);
      t.today_format_ = std::move(h.today_format);
    }
  } else if (has(text, "<|im_start|>") && has(text, "<|im_end|>")) {
    t.family_ = Family::kChatML;
    t.end_of_turn_ = "<|im_end|>";
    t.default_system_ = defaultSystem(text);
    t.empty_think_block_ = has(text, "enable_thinking") && has(text, "<think>\\n\\n</think>\\n\\n");
    t.strip_think_ = has(text, "split('</think>')");
  } else if (has(text, "[INST]") && has(text, "[/INST]") && has(text, "<<SYS>>")) {
    llama2Chat(text, source);
    t.family_ = Family::kLlama2;
    t.end_of_turn_ = eos_token;
    if (std::regex_search(text, std::regex(R"raw(['"] ['"]\s*\+\s*content\.strip\(\)\s*\+\s*['"] ['"]\s*\+\s*eos_token)raw"))) {
      t.assistant_affix_ = std::make_pair(std::string(" "), std::string());
    }
  } else if (has(text, "[INST]") && has(text, "[/INST]")) {
    t.family_ = Family::kMistral;
    t.end_of_turn_ = eos_token;
    t.space_before_close_ = has(text, "' [/INST]'") || has(text, "\" [/INST]\"");
    t.takes_system_ = has(text, "system_message");
    t.system_in_last_turn_ = has(text, "loop.last and system_message");
    std::smatch m;
    if (std::regex_search(text, m, std::regex(R"raw((['"] ['"]\s*\+\s*)?message(\[['"]content['"]\]|\.content)\s*\+\s*)raw"
                                                R"raw(eos_token(\s*\+\s*['"] ['"])?)raw"))) {
      t.assistant_affix_ = std::make_pair(std::string(m[1].matched ? " " : ""), std::string(m[3].matched ? " " : ""));
    }
  } else {
    TORCH_CHECK(false, "ChatTemplate: unsupported chat template in '", source, "': got a template without the markers "
                "of a known family (it begins \"", text.substr(0, 80), "\"), expected ", kFamilies, ". NYI: other "
                "templates need a Jinja engine; pass --prompt with the formatted text instead.");
  }
  if (writes_bos && t.family_ != Family::kChatML) {
    TORCH_CHECK(!bos_token.empty(), "ChatTemplate: no bos_token for the chat template in '", source,
                "': got a template that writes bos_token and a tokenizer_config.json without one, expected its "
                "bos_token. The folder's files are incomplete.");
    t.bos_token_ = bos_token;
  }
  TORCH_CHECK(!t.end_of_turn_.empty(), "ChatTemplate: no eos_token for the ", t.family_name(), " chat template in '",
              source, "': got none, expected tokenizer_config.json's eos_token. The folder's files are incomplete.");
  return t;
}

ChatTemplate ChatTemplate::from_folder(const std::string& folder) {
  const fs::path config = fs::path(folder) / "tokenizer_config.json";
  std::error_code ec;
  TORCH_CHECK(fs::is_regular_file(config, ec), "ChatTemplate: no tokenizer_config.json in '", folder,
              "': got a folder without one, expected the Hugging Face model folder of a chat model (it holds the "
              "chat template).");
  const json j = readJson(config, "ChatTemplate");
  std::string text;
  std::string source = config.string();
  if (j.contains("chat_template") && j.at("chat_template").is_string()) {
    text = j.at("chat_template").get<std::string>();
  } else if (j.contains("chat_template") && j.at("chat_template").is_array()) {
    for (const json& named : j.at("chat_template")) {
      if (named.is_object() && named.value("name", "") == "default" && named.contains("template") &&
          named.at("template").is_string()) {
        text = named.at("template").get<std::string>();
      }
    }
    TORCH_CHECK(!text.empty(), "ChatTemplate: no default chat template in '", source, "': got a list of named "
                "templates without \"default\", expected one named \"default\".");
  } else if (const fs::path jinja = fs::path(folder) / "chat_template.jinja"; fs::is_regular_file(jinja, ec)) {
    std::ifstream in(jinja, std::ios::binary);
    std::stringstream buffer;
    buffer << in.rdbuf();
    text = buffer.str();
    source = jinja.string();
  } else {
    TORCH_CHECK(false, "ChatTemplate: no chat template in '", folder, "': got a tokenizer_config.json without "
                "\"chat_template\" and no chat_template.jinja, expected one. A base model has none: use --prompt.");
  }
  return recognise(text, j.contains("bos_token") ? tokenText(j.at("bos_token")) : "",
                   j.contains("eos_token") ? tokenText(j.at("eos_token")) : "", source);
}

std::string ChatTemplate::today_date(const std::optional<std::string>& date_string) const {
  if (family_ != Family::kLlama3Dated) return "";
  if (date_string) {
    TORCH_CHECK(!date_string->empty(), "ChatTemplate: bad date_string for the template of '", source_, "': got an "
                "empty string, expected a date such as \"27 Nov 2026\". Leave it unset for today's date.");
    return *date_string;
  }
  if (!today_format_) return fallback_date_;
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);  // Python's datetime.now() and JS's new Date(): local time
  return strftimeC(local, *today_format_);
}

std::string ChatTemplate::format(const std::optional<std::string>& system, const std::string& user,
                                 bool enable_thinking, const std::optional<std::string>& date_string) const {
  std::vector<ChatMessage> messages;
  if (system) messages.push_back({"system", *system});
  messages.push_back({"user", user});
  return format(messages, enable_thinking, date_string);
}

// NOTE: [Earlier turns]
// How each family's template writes a conversation, e.g. [system s, user u1,
// assistant a1, user u2] (bos as the folder names it):
//   Llama 3:    bos <|start_header_id|>system<|end_header_id|>\n\n s|trim <|eot_id|> ... the same for
//               u1|trim and assistant a1|trim ... then the assistant header (3.1: the dated system block);
//   ChatML:     <|im_start|>system\n s <|im_end|>\n <|im_start|>user\n u1 <|im_end|>\n
//               <|im_start|>assistant\n a1 <|im_end|>\n ...; Qwen 3 writes of an earlier assistant turn only
//               what follows its last </think> (lstrip '\n'), unless the turn comes after the last user
//               query (a user turn that is not a <tool_response>), where the reasoning is kept;
//   Mistral:    bos [INST] u1 [/INST]a1</s> [INST] u2 [/INST] (v0.1), bos [INST] u1[/INST] a1</s>[INST] s\n\nu2[/INST]
//               (v0.3: the system message goes into the last user turn only);
//   Llama 2:    bos [INST] <<SYS>>\ns\n<</SYS>>\n\nu1 [/INST] a1|strip </s>bos [INST] u2|strip [/INST].
std::string ChatTemplate::format(const std::vector<ChatMessage>& messages, bool enable_thinking,
                                 const std::optional<std::string>& date_string) const {
  // The order every family's template accepts: [system] user (assistant user)*.
  const auto roles = [&] {
    std::string out;
    for (const ChatMessage& m : messages) out += (out.empty() ? "" : ", ") + m.role;
    return "[" + out + "]";
  };
  const bool has_system = !messages.empty() && messages[0].role == "system";
  const size_t first = has_system ? 1 : 0;
  bool ordered = messages.size() > first && messages.back().role == "user";
  for (size_t i = first; i < messages.size() && ordered; ++i) {
    ordered = messages[i].role == ((i - first) % 2 == 0 ? "user" : "assistant");
  }
  TORCH_CHECK(ordered, "ChatTemplate: bad role order for the ", family_name(), " chat template of '", source_,
              "': got ", roles(), ", expected an optional system message first, then user and assistant turns "
              "alternating, starting and ending with user ([system, user, assistant, user]). Merge or drop the "
              "messages out of order.");
  const std::optional<std::string> system = has_system ? std::optional<std::string>(messages[0].content) : std::nullopt;
  const size_t users = (messages.size() - first + 1) / 2;
  const auto needAssistantForm = [&] {
    TORCH_CHECK(users == 1 || assistant_affix_, "ChatTemplate: NYI: earlier assistant turns in the ", family_name(),
                " chat template of '", source_, "': got ", roles(), ", expected one user message (dtp does not "
                "recognise how this template writes an assistant turn). Send the conversation as one user message.");
  };

  std::string out = family_ == Family::kLlama2 ? std::string() : bos_token_;
  switch (family_) {
    case Family::kLlama3:
    case Family::kLlama3Dated: {
      size_t from = 0;
      if (family_ == Family::kLlama3Dated) {
        // The system block is written with or without a system message.
        out += "<|start_header_id|>system<|end_header_id|>\n\n" + knowledge_line_ + "Today Date: " +
               today_date(date_string) + "\n\n" + (system ? trim(*system) : std::string()) + "<|eot_id|>";
        from = first;
      }
      for (size_t i = from; i < messages.size(); ++i) {
        const std::string& c = messages[i].content;
        out += "<|start_header_id|>" + messages[i].role + "<|end_header_id|>\n\n" + (trim_content_ ? trim(c) : c) +
               "<|eot_id|>";
      }
      out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    }
    case Family::kChatML: {
      const std::optional<std::string>& sys = system ? system : default_system_;
      if (sys) out += "<|im_start|>system\n" + *sys + "<|im_end|>\n";
      // Qwen 3's last_query_index: the last user turn that is not a tool response.
      size_t last_query = messages.size() - 1;
      for (size_t i = messages.size(); i-- > first;) {
        const std::string& c = messages[i].content;
        const bool tool_response = c.rfind("<tool_response>", 0) == 0 && c.size() >= 16 &&
                                   c.compare(c.size() - 16, 16, "</tool_response>") == 0;
        if (messages[i].role == "user" && !tool_response) {
          last_query = i;
          break;
        }
      }
      for (size_t i = first; i < messages.size(); ++i) {
        std::string content = messages[i].content;
        if (messages[i].role == "assistant" && strip_think_) content = qwen3Assistant(content, i > last_query);
        out += "<|im_start|>" + messages[i].role + "\n" + content + "<|im_end|>\n";
      }
      out += "<|im_start|>assistant\n";
      if (!enable_thinking && empty_think_block_) out += "<think>\n\n</think>\n\n";
      break;
    }
    case Family::kMistral: {
      TORCH_CHECK(!system || takes_system_, "ChatTemplate: no system prompt in the Mistral template of '", source_,
                  "': got a system prompt, expected none (this [INST] template takes user and assistant turns only). "
                  "Put the instructions into the user text.");
      TORCH_CHECK(!system || users == 1 || system_in_last_turn_, "ChatTemplate: NYI: a system prompt with earlier "
                  "turns in the Mistral template of '", source_, "': got ", roles(), ", expected a template that "
                  "puts system_message into the last user turn (loop.last and system_message, Mistral v0.3's form). "
                  "Put the instructions into the user text.");
      needAssistantForm();
      for (size_t i = first; i < messages.size(); ++i) {
        const std::string& c = messages[i].content;
        if (messages[i].role == "assistant") {
          out += assistant_affix_->first + c + end_of_turn_ + assistant_affix_->second;
          continue;
        }
        const bool last = i + 1 == messages.size();
        out += "[INST] " + (system && last ? *system + "\n\n" : std::string()) + c +
               (space_before_close_ ? " [/INST]" : "[/INST]");
      }
      break;
    }
    case Family::kLlama2: {
      needAssistantForm();
      for (size_t i = first; i < messages.size(); ++i) {
        const std::string& c = messages[i].content;
        if (messages[i].role == "assistant") {
          out += assistant_affix_->first + trim(c) + " " + end_of_turn_ + assistant_affix_->second;
          continue;
        }
        const std::string turn = system && i == first ? "<<SYS>>\n" + *system + "\n<</SYS>>\n\n" + c : c;
        out += bos_token_ + "[INST] " + trim(turn) + " [/INST]";
      }
      break;
    }
  }
  return out;
}

const char* ChatTemplate::family_name() const {
  switch (family_) {
    case Family::kLlama3: return "Llama 3";
    case Family::kLlama3Dated: return "Llama 3.1";
    case Family::kChatML: return "ChatML";
    case Family::kMistral: return "Mistral";
    case Family::kLlama2: return "Llama 2 chat";
  }
  return "?";
}

std::vector<int64_t> end_token_ids(const std::string& folder, const Tokenizer& tokenizer) {
  for (const char* name : {"generation_config.json", "config.json"}) {
    const fs::path path = fs::path(folder) / name;
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) continue;
    const json j = readJson(path, "end_token_ids");
    if (!j.contains("eos_token_id") || j.at("eos_token_id").is_null()) continue;
    const json& eos = j.at("eos_token_id");
    std::vector<int64_t> ids;
    const auto add = [&](const json& id) {
      TORCH_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0, "end_token_ids: bad eos_token_id in '",
                  path.string(), "': got ", eos.dump(), ", expected an id or a list of ids.");
      ids.push_back(id.get<int64_t>());
    };
    if (eos.is_array()) {
      for (const json& id : eos) add(id);
    } else {
      add(eos);
    }
    return ids;
  }
  if (tokenizer.eos_id()) return {*tokenizer.eos_id()};
  return {};
}

}  // namespace dtp::models
