// Chat templates by family. NOTE: [Chat templates by marker]
// A chat_template is Jinja, and no C++ Jinja engine is packaged in Debian.
// The templates of the models dtp runs differ only in a few literals, so dtp
// recognises a family by the special tokens its template writes and reads the
// literals that vary (a default system prompt, a space before [/INST]) from
// the template's text. Everything else is refused by name rather than
// guessed: the families' output is compared with Hugging Face's Jinja
// rendering (@huggingface/transformers) in tests/tokenizers/.
#include "dtp/models/chat.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace dtp::models {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kFamilies =
    "Llama 3's header format (<|start_header_id|> ... <|eot_id|>), ChatML (<|im_start|> ... <|im_end|>: Qwen 2.5, "
    "Qwen 3) or Mistral's [INST] ... [/INST]";

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

}  // namespace

ChatTemplate ChatTemplate::recognise(const std::string& text, const std::string& bos_token,
                                     const std::string& eos_token, const std::string& source) {
  ChatTemplate t;
  t.source_ = source;
  const bool writes_bos = has(text, "bos_token");
  if (has(text, "<|start_header_id|>") && has(text, "<|end_header_id|>") && has(text, "<|eot_id|>")) {
    TORCH_CHECK(!has(text, "Cutting Knowledge Date"), "ChatTemplate: unsupported chat template in '", source,
                "': got Llama 3.1's template with a dated system header (\"Cutting Knowledge Date\", tools), expected ",
                kFamilies, " in its plain form. NYI: the dated Llama 3.1+ header; pass --prompt with the formatted "
                "text instead.");
    t.family_ = Family::kLlama3;
    t.end_of_turn_ = "<|eot_id|>";
    t.trim_content_ = has(text, "| trim") || has(text, "|trim");
  } else if (has(text, "<|im_start|>") && has(text, "<|im_end|>")) {
    t.family_ = Family::kChatML;
    t.end_of_turn_ = "<|im_end|>";
    t.default_system_ = defaultSystem(text);
    t.empty_think_block_ = has(text, "enable_thinking") && has(text, "<think>\\n\\n</think>\\n\\n");
  } else if (has(text, "[INST]") && has(text, "[/INST]")) {
    t.family_ = Family::kMistral;
    t.end_of_turn_ = eos_token;
    t.space_before_close_ = has(text, "' [/INST]'") || has(text, "\" [/INST]\"");
    t.takes_system_ = has(text, "system_message");
    TORCH_CHECK(!has(text, "<<SYS>>"), "ChatTemplate: unsupported chat template in '", source,
                "': got Llama 2 chat's [INST] <<SYS>> template, expected ", kFamilies, ". NYI: Llama 2 chat.");
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

std::string ChatTemplate::format(const std::optional<std::string>& system, const std::string& user,
                                 bool enable_thinking) const {
  std::string out = bos_token_;
  switch (family_) {
    case Family::kLlama3: {
      const auto turn = [&](const char* role, const std::string& content) {
        out += std::string("<|start_header_id|>") + role + "<|end_header_id|>\n\n" +
               (trim_content_ ? trim(content) : content) + "<|eot_id|>";
      };
      if (system) turn("system", *system);
      turn("user", user);
      out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    }
    case Family::kChatML: {
      const std::optional<std::string>& sys = system ? system : default_system_;
      if (sys) out += "<|im_start|>system\n" + *sys + "<|im_end|>\n";
      out += "<|im_start|>user\n" + user + "<|im_end|>\n<|im_start|>assistant\n";
      if (!enable_thinking && empty_think_block_) out += "<think>\n\n</think>\n\n";
      break;
    }
    case Family::kMistral: {
      TORCH_CHECK(!system || takes_system_, "ChatTemplate: no system prompt in the Mistral template of '", source_,
                  "': got a system prompt, expected none (this [INST] template takes user and assistant turns only). "
                  "Put the instructions into the user text.");
      out += "[INST] " + (system ? *system + "\n\n" : std::string()) + user +
             (space_before_close_ ? " [/INST]" : "[/INST]");
      break;
    }
  }
  return out;
}

const char* ChatTemplate::family_name() const {
  switch (family_) {
    case Family::kLlama3: return "Llama 3";
    case Family::kChatML: return "ChatML";
    case Family::kMistral: return "Mistral";
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
