// dtp-serve's HTTP side on rank 0: OpenAI's API (/v1/completions,
// /v1/chat/completions, /v1/models), /health and /metrics, over Debian's
// cpp-httplib. Requests are validated here (a 4xx naming the field, in
// OpenAI's error body) and handed to the engine (dtp/inference/engine.h).
#pragma once

#include "dtp/inference/engine.h"
#include "dtp/text/chat.h"
#include "dtp/text/tokenizer.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace httplib {
class Server;
}

namespace dtp::serve {

struct ServedModel {
  std::string name;                       // "model" in requests and answers
  const models::Tokenizer* tokenizer = nullptr;
  std::optional<models::ChatTemplate> chat;  // none: /v1/chat/completions answers 400
  std::vector<int64_t> stop_tokens;       // the model's end tokens
  std::vector<int64_t> chat_stop_tokens;  // those and the template's end of turn
  int64_t vocab_size = 0;                 // the model's (ids in a prompt must be below it)
  int64_t context = 0;                    // cached positions per sequence
  int64_t created = 0;                    // unix time the server started
};

void add_openai_routes(httplib::Server& server, inference::Engine& engine, const ServedModel& model);

}  // namespace dtp::serve
