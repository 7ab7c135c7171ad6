// dtp::text alone: a chat prompt formatted by its template's family and
// encoded and decoded back by the byte tokenizer, load_tokenizer linking
// every kind (tokenizer.json's PCRE2 and utf8proc, the sentencepiece module).
#include <dtp/text/chat.h>
#include <dtp/text/tokenizer.h>

#include <iostream>

int main() {
  const std::string qwen3 =
      "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
      "{%- endif %}...{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}";
  const auto chat = dtp::models::ChatTemplate::recognise(qwen3, "", "<|im_end|>", "consumer");
  const std::string prompt = chat.format(std::nullopt, "Hi");
  const auto tokenizer = dtp::models::load_tokenizer("byte");
  const std::vector<int64_t> ids = tokenizer->encode(prompt, /*add_bos=*/false);
  const bool ok = chat.family() == dtp::models::ChatTemplate::Family::kChatML &&
                  prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n" &&
                  ids.size() == prompt.size() && tokenizer->decode(ids) == prompt;
  std::cout << "dtp::text: " << (ok ? "OK" : "FAILED") << ": " << chat.family_name() << ", " << ids.size()
            << " ids\n";
  return ok ? 0 : 1;
}
