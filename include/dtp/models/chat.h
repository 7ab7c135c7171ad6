// Chat prompts from a Hugging Face model folder's chat template, without a
// Jinja engine (Debian packages none for C++): dtp recognises the template
// families of the models it runs and formats them itself.
#pragma once

#include "dtp/models/tokenizer.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dtp::models {

// The chat template of a tokenizer_config.json ("chat_template", a string or
// the "default" of a named list) or of a chat_template.jinja beside it,
// recognised by markers:
//   - kLlama3: Llama 3's header format (<|start_header_id|>, <|eot_id|>);
//   - kChatML: <|im_start|> / <|im_end|> (Qwen 2.5, Qwen 3), with the
//     template's default system prompt when it has one (Qwen 2.5: "You are
//     Qwen, created by Alibaba Cloud. ...");
//   - kMistral: [INST] ... [/INST], with or without a space before [/INST]
//     as the template writes it; a system prompt only where the template
//     takes one (system_message, Mistral v0.3's form).
// Any other template, and Llama 3.1's dated system header ("Cutting
// Knowledge Date"), is an error naming the file and the supported families.
class ChatTemplate {
 public:
  enum class Family { kLlama3, kChatML, kMistral };

  // From `folder`/tokenizer_config.json (bos_token and eos_token with it).
  static ChatTemplate from_folder(const std::string& folder);
  // From a template's text; `source` names it in errors.
  static ChatTemplate recognise(const std::string& text, const std::string& bos_token, const std::string& eos_token,
                                const std::string& source);

  // What Hugging Face's apply_chat_template(messages, tokenize=False,
  // add_generation_prompt=True) renders for [{system}], {user}: the prompt
  // ends with the assistant's header. Qwen 3: as with enable_thinking unset,
  // nothing follows "<|im_start|>assistant\n", so the model may open with
  // <think>; enable_thinking=false appends the template's empty
  // "<think>\n\n</think>\n\n" block (HF's enable_thinking=False).
  std::string format(const std::optional<std::string>& system, const std::string& user,
                     bool enable_thinking = true) const;

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
};

// The ids generation stops at in a model folder: generation_config.json's
// eos_token_id (an id or a list: Llama 3 Instruct's [128001, 128008,
// 128009]), else config.json's, else the tokenizer's eos_id(); empty when
// none says.
std::vector<int64_t> end_token_ids(const std::string& folder, const Tokenizer& tokenizer);

}  // namespace dtp::models
