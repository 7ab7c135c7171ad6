// Chat prompts from a Hugging Face model folder's chat template, without a
// Jinja engine (Debian packages none for C++): dtp recognises the template
// families of the models it runs and formats them itself.
#pragma once

#include "dtp/text/tokenizer.h"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dtp::models {

// One message of a conversation: role "system", "user" or "assistant".
struct ChatMessage {
  std::string role;
  std::string content;
};

// The chat template of a tokenizer_config.json ("chat_template", a string or
// the "default" of a named list) or of a chat_template.jinja beside it,
// recognised by markers:
//   - kLlama3: Llama 3's header format (<|start_header_id|>, <|eot_id|>);
//   - kLlama3Dated: Llama 3.1 / 3.2 / 3.3 Instruct's header format with the
//     dated system block, always written ("Cutting Knowledge Date: December
//     2023\nToday Date: <date>\n\n" then the trimmed system message, empty
//     when none is given). See NOTE: [Today Date];
//   - kChatML: <|im_start|> / <|im_end|> (Qwen 2.5, Qwen 3), with the
//     template's default system prompt when it has one (Qwen 2.5: "You are
//     Qwen, created by Alibaba Cloud. ...");
//   - kMistral: [INST] ... [/INST], with or without a space before [/INST]
//     as the template writes it; a system prompt only where the template
//     takes one (system_message, Mistral v0.3's form);
//   - kLlama2: Llama 2 chat's "[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user}
//     [/INST]", stripped as its template strips the turn.
// Any other template (images, a default system prompt in Llama 2's form, a
// system block written only when there is a system message, tools by
// default) is an error naming the file and the supported families.
//
// NOTE: [Today Date]
// Llama 3.1 / 3.3 write `date_string`, defaulting to the template's literal
// ("26 Jul 2024"); Llama 3.2 sets it from strftime_now("%d %b %Y") where the
// renderer defines strftime_now, as Python transformers and
// @huggingface/transformers (JS) both do (local time), so it renders today's
// date, e.g. "27 Nov 2026". dtp does the same (English month names, as
// Python's C locale); HF's date_string keyword (dtp-generate --chat-date)
// overrides both. The reference test pins it for determinism.
class ChatTemplate {
 public:
  enum class Family { kLlama3, kLlama3Dated, kChatML, kMistral, kLlama2 };

  // From `folder`/tokenizer_config.json (bos_token and eos_token with it).
  static ChatTemplate from_folder(const std::string& folder);
  // From a template's text; `source` names it in errors.
  static ChatTemplate recognise(const std::string& text, const std::string& bos_token, const std::string& eos_token,
                                const std::string& source);

  // What Hugging Face's apply_chat_template(messages, tokenize=False,
  // add_generation_prompt=True) renders for a conversation: an optional
  // system message first, then user and assistant turns alternating,
  // starting and ending with user (any other order is an error naming it).
  // The prompt ends with the assistant's header. Earlier assistant turns are
  // written as each template writes them (see NOTE: [Earlier turns]).
  // Qwen 3: as with enable_thinking unset, nothing follows
  // "<|im_start|>assistant\n", so the model may open with <think>;
  // enable_thinking=false appends the template's empty
  // "<think>\n\n</think>\n\n" block (HF's enable_thinking=False).
  // `date_string`: HF's keyword of that name, the Today Date of kLlama3Dated
  // (ignored by the other families); see NOTE: [Today Date].
  std::string format(const std::vector<ChatMessage>& messages, bool enable_thinking = true,
                     const std::optional<std::string>& date_string = std::nullopt) const;
  // The single-turn form: format({[system], user}).
  std::string format(const std::optional<std::string>& system, const std::string& user,
                     bool enable_thinking = true, const std::optional<std::string>& date_string = std::nullopt) const;
  // The Today Date that format() writes for kLlama3Dated: `date_string` if
  // given, else today's date in the template's strftime_now format if it
  // calls strftime_now, else its fallback literal; empty for other families.
  std::string today_date(const std::optional<std::string>& date_string = std::nullopt) const;

  Family family() const { return family_; }
  const char* family_name() const;
  // The token that closes a turn (<|eot_id|>, <|im_end|>, or the EOS for
  // Mistral): generation stops there too.
  const std::string& end_of_turn() const { return end_of_turn_; }
  // The file the template came from.
  const std::string& source() const { return source_; }

 private:
  Family family_ = Family::kChatML;
  std::string source_;
  std::string bos_token_;
  std::string end_of_turn_;
  bool trim_content_ = false;                 // Llama 3: message['content'] | trim
  std::optional<std::string> default_system_;  // ChatML: Qwen 2.5's
  bool empty_think_block_ = false;            // ChatML: the template knows enable_thinking
  bool space_before_close_ = true;            // Mistral: ' [/INST]' or '[/INST]'
  bool takes_system_ = false;                 // Mistral: system_message
  // Mistral, Llama 2: what an earlier assistant turn writes before its
  // content and after its EOS (Mistral v0.1: {"", " "}, v0.3: {" ", ""},
  // Llama 2: {" ", ""} with " " before the EOS); unset when the template's
  // form is not recognised: assistant turns are then refused by name.
  std::optional<std::pair<std::string, std::string>> assistant_affix_;
  bool system_in_last_turn_ = false;          // Mistral v0.3: loop.last and system_message
  bool strip_think_ = false;                  // ChatML: Qwen 3 drops earlier turns' <think>...</think>
  std::string knowledge_line_;                // kLlama3Dated: "Cutting Knowledge Date: December 2023\n"
  std::string fallback_date_;                 // kLlama3Dated: set date_string = "26 Jul 2024"
  std::optional<std::string> today_format_;   // kLlama3Dated: strftime_now("%d %b %Y")
};

// The ids generation stops at in a model folder: generation_config.json's
// eos_token_id (an id or a list: Llama 3 Instruct's [128001, 128008,
// 128009]), else config.json's, else the tokenizer's eos_id(); empty when
// none says.
std::vector<int64_t> end_token_ids(const std::string& folder, const Tokenizer& tokenizer);

}  // namespace dtp::models
