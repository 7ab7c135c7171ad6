#include "openai_api.h"

#include "peer_watch.h"

#include <c10/util/Exception.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <cstdio>
#include <random>
#include <sstream>

namespace dtp::serve {
namespace {

using nlohmann::json;

// A request that is refused: OpenAI's error body with this status.
struct ApiError {
  int status;
  std::string message, type, param, code;
};

std::string dump(const json& j) {
  // Byte tokens may form invalid UTF-8: replaced (U+FFFD) rather than throwing.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

json errorBody(const ApiError& e) {
  return {{"error",
           {{"message", e.message},
            {"type", e.type},
            {"param", e.param.empty() ? json(nullptr) : json(e.param)},
            {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
}

void sendError(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(dump(errorBody(e)), "application/json");
}

ApiError badRequest(const std::string& param, const std::string& message) {
  return {400, message, "invalid_request_error", param, ""};
}

int64_t unixNow() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string kindOf(const json& j) {
  switch (j.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    case json::value_t::number_float: return "a number (" + j.dump() + ")";
    default: return "an integer (" + j.dump() + ")";
  }
}

// The parameters both endpoints share, checked.
struct Common {
  std::optional<int64_t> max_tokens;
  inference::SamplingOptions sampling;
  uint64_t seed = 0;
  std::vector<std::string> stop;
  bool stream = false, include_usage = false, return_token_ids = false;
  bool return_tokens_as_token_ids = false;  // vLLM's: logprobs name tokens "token_id:<id>"
  int64_t n = 1;          // choices (see NOTE: [n choices])
  int64_t logprobs = -1;  // -1: none; else the top logprobs per token (RequestOptions::logprobs)
};

// vLLM's and OpenAI's bound on n is the server's; 16 keeps one request from
// filling a batch of --max-batch 16 on its own.
constexpr int64_t kMaxChoices = 16;

// Chat: "logprobs": true and "top_logprobs": 0..20 (OpenAI's); completions:
// "logprobs": 0..20 (OpenAI allows 5, vLLM 20, the engine's kMaxTopLogprobs).
void parseLogprobs(const json& body, bool chat, Common& c) {
  const std::string range = "[0, " + std::to_string(inference::kMaxTopLogprobs) + "]";
  const bool has = body.contains("logprobs") && !body["logprobs"].is_null();
  if (chat) {
    if (has && !body["logprobs"].is_boolean()) {
      throw badRequest("logprobs", "logprobs: got " + kindOf(body["logprobs"]) + ", expected a boolean (top_logprobs "
                                   "says how many alternatives).");
    }
    const bool on = has && body["logprobs"].get<bool>();
    if (body.contains("top_logprobs") && !body["top_logprobs"].is_null()) {
      const json& v = body["top_logprobs"];
      if (!on) {
        throw badRequest("top_logprobs", "top_logprobs: got " + kindOf(v) + " without logprobs, expected logprobs: true "
                                         "with it. Set logprobs to true.");
      }
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > inference::kMaxTopLogprobs) {
        throw badRequest("top_logprobs", "top_logprobs: got " + kindOf(v) + ", expected an integer in " + range + ".");
      }
      c.logprobs = v.get<int64_t>();
    } else if (on) {
      c.logprobs = 0;
    }
    return;
  }
  if (!has) return;
  const json& v = body["logprobs"];
  if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > inference::kMaxTopLogprobs) {
    throw badRequest("logprobs", "logprobs: got " + kindOf(v) + ", expected null or an integer in " + range +
                                 " (the alternatives per token).");
  }
  c.logprobs = v.get<int64_t>();
}

Common parseCommon(const json& body, const ServedModel& model, bool chat) {
  Common c;
  if (body.contains("model") && !body["model"].is_null()) {
    if (!body["model"].is_string()) throw badRequest("model", "model: got " + kindOf(body["model"]) + ", expected a string.");
    const std::string name = body["model"];
    if (name != model.name) {
      throw ApiError{404, "The model '" + name + "' does not exist: this server serves '" + model.name + "'.",
                     "invalid_request_error", "model", "model_not_found"};
    }
  }
  auto integer = [&](const char* key, int64_t lo) -> std::optional<int64_t> {
    if (!body.contains(key) || body[key].is_null()) return std::nullopt;
    const json& v = body[key];
    if (!v.is_number_integer() || v.get<int64_t>() < lo) {
      throw badRequest(key, std::string(key) + ": got " + kindOf(v) + ", expected an integer >= " + std::to_string(lo) + ".");
    }
    return v.get<int64_t>();
  };
  auto number = [&](const char* key, double lo, double hi, bool open_lo) -> std::optional<double> {
    if (!body.contains(key) || body[key].is_null()) return std::nullopt;
    const json& v = body[key];
    const bool ok = v.is_number() && (open_lo ? v.get<double>() > lo : v.get<double>() >= lo) && v.get<double>() <= hi;
    if (!ok) {
      throw badRequest(key, std::string(key) + ": got " + kindOf(v) + ", expected a number in " + (open_lo ? "(" : "[") +
                                std::to_string(lo).substr(0, 3) + ", " + std::to_string(hi).substr(0, 3) + "].");
    }
    return v.get<double>();
  };
  auto boolean = [&](const json& obj, const char* key, const char* param) {
    if (!obj.contains(key) || obj[key].is_null()) return false;
    if (!obj[key].is_boolean()) throw badRequest(param, std::string(param) + ": got " + kindOf(obj[key]) + ", expected a boolean.");
    return obj[key].get<bool>();
  };
  c.max_tokens = integer("max_tokens", 1);
  if (chat && !c.max_tokens) {
    if (auto m = integer("max_completion_tokens", 1)) c.max_tokens = m;
  }
  if (auto t = number("temperature", 0.0, 2.0, false)) c.sampling.temperature = *t;
  if (auto p = number("top_p", 0.0, 1.0, true)) c.sampling.top_p = *p;
  if (body.contains("top_k") && body["top_k"].is_number_integer() && body["top_k"].get<int64_t>() == -1) {
    c.sampling.top_k = 0;  // vLLM's "no top-k"
  } else if (auto k = integer("top_k", 0)) {
    c.sampling.top_k = *k;
  }
  if (body.contains("seed") && !body["seed"].is_null()) {
    if (!body["seed"].is_number_integer()) throw badRequest("seed", "seed: got " + kindOf(body["seed"]) + ", expected an integer.");
    c.seed = body["seed"].is_number_unsigned() ? body["seed"].get<uint64_t>()
                                                        : static_cast<uint64_t>(body["seed"].get<int64_t>());
  } else {
    static std::atomic<uint64_t> counter{std::random_device{}()};
    c.seed = counter.fetch_add(0x9E3779B97F4A7C15ULL);
  }
  if (body.contains("stop") && !body["stop"].is_null()) {
    const json& s = body["stop"];
    if (s.is_string()) {
      c.stop.push_back(s.get<std::string>());
    } else if (s.is_array() && s.size() <= 4) {
      for (const json& x : s) {
        if (!x.is_string()) throw badRequest("stop", "stop: got an array holding " + kindOf(x) + ", expected strings.");
        c.stop.push_back(x.get<std::string>());
      }
    } else {
      throw badRequest("stop", "stop: got " + kindOf(s) + (s.is_array() ? " of " + std::to_string(s.size()) : "") +
                                   ", expected a string or an array of at most 4 strings.");
    }
    for (const auto& x : c.stop) {
      if (x.empty()) throw badRequest("stop", "stop: got an empty string, expected non-empty stop strings.");
    }
  }
  c.stream = boolean(body, "stream", "stream");
  if (body.contains("stream_options") && body["stream_options"].is_object()) {
    c.include_usage = boolean(body["stream_options"], "include_usage", "stream_options.include_usage");
  }
  c.return_token_ids = boolean(body, "return_token_ids", "return_token_ids");
  c.return_tokens_as_token_ids = boolean(body, "return_tokens_as_token_ids", "return_tokens_as_token_ids");
  if (body.contains("n") && !body["n"].is_null()) {
    const json& v = body["n"];
    if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > kMaxChoices) {
      throw badRequest("n", "n: got " + kindOf(v) + ", expected an integer in [1, " + std::to_string(kMaxChoices) +
                                "]. Send several requests for more choices.");
    }
    c.n = v.get<int64_t>();
  }
  parseLogprobs(body, chat, c);
  if (body.contains("echo") && body["echo"] == true) throw badRequest("echo", "NYI: echo: got true, expected false.");
  return c;
}

std::vector<int64_t> promptIds(const json& body, const ServedModel& model) {
  if (!body.contains("prompt")) throw badRequest("prompt", "prompt: missing, expected a string or an array of token ids.");
  json p = body["prompt"];
  // A batch of one is the prompt itself.
  if (p.is_array() && p.size() == 1 && (p[0].is_string() || p[0].is_array())) p = json(p[0]);
  std::vector<int64_t> ids;
  if (p.is_string()) {
    ids = model.tokenizer->encode(p.get<std::string>(), /*add_bos=*/true);
  } else if (p.is_array() && !p.empty() && p[0].is_number_integer()) {
    for (const json& t : p) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= model.vocab_size) {
        throw badRequest("prompt", "prompt: got the token " + t.dump() + ", expected ids in [0, " +
                                       std::to_string(model.vocab_size) + ").");
      }
      ids.push_back(t.get<int64_t>());
    }
  } else if (p.is_array() && p.size() > 1) {
    throw badRequest("prompt", "NYI: prompt: got an array of " + std::to_string(p.size()) +
                                   " prompts, expected one (send one request per prompt).");
  } else {
    throw badRequest("prompt", "prompt: got " + kindOf(p) + ", expected a string or an array of token ids.");
  }
  if (ids.empty()) throw badRequest("prompt", "prompt: got an empty prompt, expected at least one token.");
  return ids;
}

std::string contentOf(const json& m, size_t i) {
  const std::string param = "messages[" + std::to_string(i) + "].content";
  if (!m.contains("content")) throw badRequest(param, param + ": missing, expected a string.");
  const json& c = m["content"];
  if (c.is_string()) return c.get<std::string>();
  if (c.is_array()) {  // [{"type": "text", "text": ...}, ...]
    std::string out;
    for (const json& part : c) {
      if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string()) {
        throw badRequest(param, param + ": got a part that is not {\"type\": \"text\", \"text\": string}, expected text parts.");
      }
      out += part["text"].get<std::string>();
    }
    return out;
  }
  throw badRequest(param, param + ": got " + kindOf(c) + ", expected a string or an array of text parts.");
}

std::vector<int64_t> chatIds(const json& body, const ServedModel& model) {
  if (!model.chat) {
    throw badRequest("messages", "messages: this model's folder has no chat template (tokenizer_config.json with a "
                                 "chat_template and a tokenizer.json): use /v1/completions.");
  }
  if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty()) {
    throw badRequest("messages", "messages: got " + (body.contains("messages") ? kindOf(body["messages"]) : std::string("nothing")) +
                                     ", expected a non-empty array of messages.");
  }
  const json& ms = body["messages"];
  // The whole conversation goes to the template, which refuses a role order
  // its family does not take (a 400 with its message).
  std::vector<dtp::models::ChatMessage> messages;
  for (size_t i = 0; i < ms.size(); ++i) {
    const json& m = ms[i];
    const std::string param = "messages[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
      throw badRequest(param, param + ": got " + kindOf(m) + ", expected an object with a string role.");
    }
    const std::string role = m["role"];
    // OpenAI's "developer" is the system message of newer models.
    messages.push_back({role == "developer" && i == 0 ? std::string("system") : role, contentOf(m, i)});
  }
  std::string prompt;
  try {
    prompt = model.chat->format(messages);
  } catch (const c10::Error& e) {
    throw badRequest("messages", e.what_without_backtrace());
  }
  // The template writes the BOS itself.
  return model.tokenizer->encode(prompt, /*add_bos=*/false);
}

std::string sse(const json& j) { return "data: " + dump(j) + "\n\n"; }

// NOTE: [Logprobs in the answer] The engine gives, per drawn token, its
// log-probability and the k best (token, logprob) pairs, best first
// (RequestOptions::logprobs; the log-softmax of the raw logits, whatever the
// temperature, as vLLM's default). Each token's text is the tokenizer's
// decode_token(id) with special tokens spelled out (so <|im_end|> shows), as
// vLLM shows them; a byte token that is part of a UTF-8 character is that
// byte (chat's "bytes" carries it; the string shows U+FFFD). JSON has no
// -inf: a token the model cannot draw shows vLLM's -9999.0.
//   chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [k x {"token", "logprob", "bytes"}]}]}
//   completions: {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{text: logprob} per token],
//                 "text_offset": [...]}
// Completions' top_logprobs holds the k best and the drawn token (OpenAI's
// "up to logprobs + 1 elements"); two tokens with one text keep the better.
// text_offset counts bytes of the choice's text (characters for ASCII).
// With vLLM's return_tokens_as_token_ids, a token's text is "token_id:<id>"
// (what a client that cannot decode ids, or a test, compares). So is an id
// the tokenizer does not know: a model's vocabulary padded past its
// tokenizer's (Qwen 2.5: 151936 rows, 151665 tokens; the tests' tiny model:
// 256 rows, a ChatML tokenizer of 38) has such ids among the top logprobs;
// chat's "bytes" is then null (OpenAI's "no bytes representation").
struct TokenText {
  const models::Tokenizer& tokenizer;
  bool as_ids;
  bool known(int64_t id) const { return id >= 0 && id < tokenizer.vocab_size(); }
  std::string operator()(int64_t id) const {
    if (as_ids || !known(id)) return "token_id:" + std::to_string(id);
    return tokenizer.decode_token(id, /*skip_special_tokens=*/false);
  }
  json bytes(int64_t id) const;
};

double finiteLogprob(double x) { return std::max(x, -9999.0); }

json TokenText::bytes(int64_t id) const {
  if (!known(id)) return nullptr;
  json b = json::array();
  for (unsigned char ch : tokenizer.decode_token(id, /*skip_special_tokens=*/false)) b.push_back(static_cast<int>(ch));
  return b;
}

json chatLogprobs(const std::vector<inference::TokenLogprobs>& lps, const TokenText& tokenizer) {
  json content = json::array();
  for (const auto& t : lps) {
    json top = json::array();
    for (const auto& a : t.top) {
      const std::string text = tokenizer(a.token);
      top.push_back({{"token", text}, {"logprob", finiteLogprob(a.logprob)}, {"bytes", tokenizer.bytes(a.token)}});
    }
    const std::string text = tokenizer(t.token);
    content.push_back({{"token", text}, {"logprob", finiteLogprob(t.logprob)}, {"bytes", tokenizer.bytes(t.token)}, {"top_logprobs", top}});
  }
  return {{"content", content}};
}

// `offset`: bytes of the choice's text before these tokens; advanced past them.
json completionLogprobs(const std::vector<inference::TokenLogprobs>& lps, const TokenText& tokenizer, int64_t& offset) {
  json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(), text_offset = json::array();
  for (const auto& t : lps) {
    const std::string text = tokenizer(t.token);
    json alternatives = json::object();
    for (const auto& a : t.top) {
      const std::string key = tokenizer(a.token);
      if (!alternatives.contains(key)) alternatives[key] = finiteLogprob(a.logprob);
    }
    if (!alternatives.contains(text)) alternatives[text] = finiteLogprob(t.logprob);
    tokens.push_back(text);
    token_logprobs.push_back(finiteLogprob(t.logprob));
    top_logprobs.push_back(alternatives);
    text_offset.push_back(offset);
    offset += static_cast<int64_t>(text.size());
  }
  return {{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top_logprobs}, {"text_offset", text_offset}};
}

// One choice as the HTTP thread sees it: the engine's outputs for one of the
// request's n engine requests, collected by its callback (on the engine's
// thread).
struct Choice {
  std::string pending;  // settled text not yet streamed
  std::string text;     // all of it
  std::vector<int64_t> tokens;
  std::vector<inference::TokenLogprobs> logprobs;
  size_t streamed_logprobs = 0;  // of logprobs, those streamed
  bool done = false, finish_streamed = false;
  std::string finish_reason;
  std::string error;  // the engine failed it: 503 with this
};

// NOTE: [n choices] A request with n > 1 is n engine requests with seeds
// seed, seed + 1, ..., seed + n - 1 (vLLM's rule for its child requests), so
// choice i equals a request with n = 1 and seed + i; greedy choices are
// equal. The prompt counts once in the usage, the completion tokens of all
// choices add up. A client that goes away cancels all n.
struct Reply {
  std::mutex m;
  std::condition_variable cv;
  std::vector<Choice> choices;
  int64_t prompt_tokens = 0;

  bool done() const {
    return std::all_of(choices.begin(), choices.end(), [](const Choice& c) { return c.done; });
  }
  std::string error() const {
    for (const Choice& c : choices) {
      if (!c.error.empty()) return c.error;
    }
    return "";
  }
  // Whether a streamed chunk has something to carry.
  bool news() const {
    return std::any_of(choices.begin(), choices.end(), [](const Choice& c) {
      return !c.pending.empty() || c.streamed_logprobs < c.logprobs.size() || (c.done && !c.finish_streamed);
    });
  }
};

json usageOf(const Reply& r) {
  int64_t completion = 0;
  for (const Choice& c : r.choices) completion += static_cast<int64_t>(c.tokens.size());
  const int64_t p = r.prompt_tokens;
  return {{"prompt_tokens", p}, {"completion_tokens", completion}, {"total_tokens", p + completion}};
}

// What one streamed chunk carries for one choice.
struct Delta {
  int64_t index = 0;
  std::string text;
  std::vector<inference::TokenLogprobs> logprobs;
  bool finish = false;
  std::string finish_reason;
  std::vector<int64_t> tokens;  // all of the choice's, at its finish
};

void handle(const httplib::Request& req, httplib::Response& res, inference::Engine& engine, const ServedModel& model,
            bool chat) {
  auto r = std::make_shared<Reply>();
  Common c;
  std::vector<int64_t> prompt;
  std::vector<int64_t> request_ids;
  auto cancelAll = [&engine](const std::vector<int64_t>& ids) {
    for (int64_t id : ids) engine.cancel(id);
  };
  try {
    json body;
    try {
      body = json::parse(req.body);
    } catch (const json::parse_error& e) {
      throw ApiError{400, std::string("We could not parse the JSON body of your request: ") + e.what(),
                     "invalid_request_error", "", ""};
    }
    if (!body.is_object()) throw badRequest("", "The body: got " + kindOf(body) + ", expected a JSON object.");
    c = parseCommon(body, model, chat);
    prompt = chat ? chatIds(body, model) : promptIds(body, model);
    const int64_t n = static_cast<int64_t>(prompt.size());
    const char* prompt_param = chat ? "messages" : "prompt";
    if (n >= model.context) {
      throw badRequest(prompt_param, std::string(prompt_param) + ": got " + std::to_string(n) +
                                         " tokens, expected fewer than this model's maximum context length of " +
                                         std::to_string(model.context) + " tokens. Shorten the prompt.");
    }
    const int64_t max_tokens = c.max_tokens.value_or(chat ? model.context - n : 16);
    if (n + max_tokens > model.context) {
      throw badRequest("max_tokens", "max_tokens: got " + std::to_string(max_tokens) + " with a prompt of " +
                                         std::to_string(n) + " tokens, expected at most " +
                                         std::to_string(model.context - n) + " (this model's maximum context length is " +
                                         std::to_string(model.context) + " tokens).");
    }
    inference::RequestOptions o;
    o.sampling = c.sampling;
    o.max_tokens = max_tokens;
    o.stop = c.stop;
    o.stop_tokens = chat ? model.chat_stop_tokens : model.stop_tokens;
    o.logprobs = c.logprobs;
    r->prompt_tokens = n;
    r->choices.resize(static_cast<size_t>(c.n));  // before the first callback can run
    for (int64_t i = 0; i < c.n; ++i) {
      o.seed = c.seed + static_cast<uint64_t>(i);  // See NOTE: [n choices]
      const inference::Ticket t = engine.enqueue(prompt, o, [r, i, want = c.logprobs](const inference::Output& out) {
        std::lock_guard<std::mutex> lk(r->m);
        Choice& ch = r->choices[static_cast<size_t>(i)];
        ch.pending += out.text;
        ch.text += out.text;
        ch.tokens.insert(ch.tokens.end(), out.tokens.begin(), out.tokens.end());
        if (want >= 0 && out.logprobs.size() != out.tokens.size() && ch.error.empty()) {
          ch.error = "dtp-serve: the engine returned " + std::to_string(out.logprobs.size()) + " logprobs for " +
                     std::to_string(out.tokens.size()) + " tokens, expected one per token (RequestOptions::logprobs " +
                     std::to_string(want) + "). This is a bug: report it.";
        } else if (want >= 0) {
          ch.logprobs.insert(ch.logprobs.end(), out.logprobs.begin(), out.logprobs.end());
        }
        if (out.finished) {
          ch.done = true;
          ch.finish_reason = inference::finish_reason_name(out.finish_reason);
          if (out.finish_reason == inference::FinishReason::kError) ch.error = out.error;
        }
        r->cv.notify_all();
      });
      if (t.refused != inference::Refusal::kNone) cancelAll(request_ids);  // all n or none
      switch (t.refused) {
        case inference::Refusal::kNone: break;
        case inference::Refusal::kQueueFull:
          throw ApiError{429, "dtp-serve: too many queued requests (--max-queue). Retry later.", "rate_limit_exceeded", "", ""};
        case inference::Refusal::kStopping:
          throw ApiError{503, "dtp-serve is shutting down.", "server_error", "", ""};
        case inference::Refusal::kDead:
          throw ApiError{503, t.why, "server_error", "", ""};
      }
      request_ids.push_back(t.id);
    }
  } catch (const ApiError& e) {
    sendError(res, e);
    return;
  } catch (const std::exception& e) {  // a tokenizer or template error
    sendError(res, badRequest(chat ? "messages" : "prompt", e.what()));
    return;
  }
  const std::string id = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(request_ids.front());
  const int64_t created = unixNow();
  const std::string object = chat ? "chat.completion" : "text_completion";
  const TokenText tokenizer{*model.tokenizer, c.return_tokens_as_token_ids};
  if (!c.stream) {
    // A client that goes away while it waits cancels the request
    // (NOTE: [A client that hangs up] in peer_watch.h).
    const PeerWatch peer(req.remote_addr, req.remote_port);
    std::unique_lock<std::mutex> lk(r->m);
    while (!r->cv.wait_for(lk, std::chrono::milliseconds(200), [&] { return r->done(); })) {
      if (peer.closed()) {
        lk.unlock();
        cancelAll(request_ids);
        return;
      }
    }
    if (!r->error().empty()) {
      sendError(res, ApiError{503, r->error(), "server_error", "", ""});
      return;
    }
    // A bug below (a tokenizer that throws) is a 500 in OpenAI's body, not
    // httplib's bare 500 with a backtrace in a header.
    try {
      json choices = json::array();
      for (size_t i = 0; i < r->choices.size(); ++i) {
        const Choice& ch = r->choices[i];
        json choice = {{"index", i}, {"finish_reason", ch.finish_reason}, {"logprobs", nullptr}};
        if (c.logprobs >= 0) {
          int64_t offset = 0;
          choice["logprobs"] = chat ? chatLogprobs(ch.logprobs, tokenizer)
                                    : completionLogprobs(ch.logprobs, tokenizer, offset);
        }
        if (chat) {
          choice["message"] = {{"role", "assistant"}, {"content", ch.text}};
        } else {
          choice["text"] = ch.text;
        }
        if (c.return_token_ids) choice["token_ids"] = ch.tokens;
        choices.push_back(choice);
      }
      json out = {{"id", id}, {"object", object}, {"created", created}, {"model", model.name},
                  {"choices", choices}, {"usage", usageOf(*r)}};
      if (c.return_token_ids) out["prompt_token_ids"] = prompt;
      res.set_content(dump(out), "application/json");
    } catch (const std::exception& e) {
      sendError(res, ApiError{500, std::string("dtp-serve: ") + e.what(), "server_error", "", ""});
    }
    return;
  }
  // Server-sent events: per choice, one chunk per settled piece of text (with
  // its tokens' logprobs), then its finish reason; at the end the usage if
  // asked, and [DONE]. Chunks carry their choice's index.
  auto started = std::make_shared<bool>(false);
  auto offsets = std::make_shared<std::vector<int64_t>>(r->choices.size(), 0);  // completions' text_offset
  const std::string chunk_object = chat ? "chat.completion.chunk" : "text_completion";
  auto chunk = [=, name = model.name](int64_t index, const json& delta_or_text, const json& finish, const json& logprobs) {
    json choice = {{"index", index}, {"finish_reason", finish}, {"logprobs", logprobs}};
    if (chat) {
      choice["delta"] = delta_or_text;
    } else {
      choice["text"] = delta_or_text;
    }
    return json{{"id", id}, {"object", chunk_object}, {"created", created}, {"model", name},
                {"choices", json::array({choice})}};
  };
  res.set_header("Cache-Control", "no-cache");
  // The client went away: every choice's row leaves.
  auto cancel = [cancelAll, request_ids] { cancelAll(request_ids); };
  res.set_chunked_content_provider(
      "text/event-stream",
      [r, c, chat, started, offsets, chunk, id, created, chunk_object, cancel, tokenizer,
       name = model.name](size_t, httplib::DataSink& sink) {
        std::unique_lock<std::mutex> lk(r->m);
        r->cv.wait_for(lk, std::chrono::milliseconds(200), [&] { return r->done() || r->news(); });
        std::vector<Delta> deltas;
        for (size_t i = 0; i < r->choices.size(); ++i) {
          Choice& ch = r->choices[i];
          Delta d;
          d.index = static_cast<int64_t>(i);
          d.text = std::move(ch.pending);
          ch.pending.clear();
          d.logprobs.assign(ch.logprobs.begin() + static_cast<std::ptrdiff_t>(ch.streamed_logprobs), ch.logprobs.end());
          ch.streamed_logprobs = ch.logprobs.size();
          // A failed choice gets no finish chunk: the error event ends the stream.
          d.finish = ch.done && !ch.finish_streamed && ch.error.empty();
          if (ch.done) ch.finish_streamed = true;
          d.finish_reason = ch.finish_reason;
          if (d.finish) d.tokens = ch.tokens;
          if (!d.text.empty() || !d.logprobs.empty() || d.finish) deltas.push_back(std::move(d));
        }
        const bool done = r->done();
        const std::string error = done ? r->error() : "";
        lk.unlock();
        std::string out;
        if (!*started && chat) {
          for (size_t i = 0; i < offsets->size(); ++i) {
            out += sse(chunk(static_cast<int64_t>(i), json{{"role", "assistant"}, {"content", ""}}, nullptr, nullptr));
          }
        }
        *started = true;
        for (const Delta& d : deltas) {
          if (!d.text.empty() || !d.logprobs.empty()) {
            json logprobs = nullptr;
            if (c.logprobs >= 0) {
              logprobs = chat ? chatLogprobs(d.logprobs, tokenizer)
                              : completionLogprobs(d.logprobs, tokenizer, (*offsets)[static_cast<size_t>(d.index)]);
            }
            out += sse(chunk(d.index, chat ? json{{"content", d.text}} : json(d.text), nullptr, logprobs));
          }
          if (d.finish) {
            json last = chunk(d.index, chat ? json::object() : json(""), d.finish_reason, nullptr);
            if (c.return_token_ids) last["choices"][0]["token_ids"] = d.tokens;
            out += sse(last);
          }
        }
        if (done) {
          if (!error.empty()) {
            out += sse(errorBody(ApiError{503, error, "server_error", "", ""}));
          } else if (c.include_usage) {
            json usage;
            {
              std::lock_guard<std::mutex> g(r->m);
              usage = usageOf(*r);
            }
            out += sse(json{{"id", id}, {"object", chunk_object}, {"created", created}, {"model", name},
                            {"choices", json::array()}, {"usage", usage}});
          }
          out += "data: [DONE]\n\n";
        }
        if (!out.empty() && !sink.write(out.data(), out.size())) {
          cancel();
          return false;
        }
        if (!sink.is_writable()) {
          cancel();
          return false;
        }
        if (done) sink.done();
        return true;
      },
      [cancel](bool success) {
        if (!success) cancel();
      });
}

std::string metricsText(const inference::EngineMetrics& m) {
  std::ostringstream o;
  auto counter = [&](const char* name, const char* help, int64_t v, const char* type = "counter") {
    o << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n" << name << " " << v << "\n";
  };
  counter("dtp_serve_requests_total", "Requests accepted into the queue.", m.requests);
  counter("dtp_serve_requests_finished_total", "Requests that finished (stop or length).", m.finished);
  counter("dtp_serve_requests_failed_total", "Requests that failed after they were accepted.", m.failed);
  counter("dtp_serve_requests_rejected_total", "Requests refused because the queue was full.", m.rejected);
  counter("dtp_serve_prompt_tokens_total", "Prompt tokens of accepted requests.", m.prompt_tokens);
  counter("dtp_serve_generation_tokens_total", "Tokens generated.", m.generation_tokens);
  counter("dtp_serve_steps_total", "Engine steps run.", m.steps);
  counter("dtp_serve_queue_depth", "Requests waiting to start.", m.waiting, "gauge");
  counter("dtp_serve_running", "Sequences in the running batch.", m.running, "gauge");
  counter("dtp_serve_requests_cancelled_total", "Requests whose client went away before the end (their sequence stopped).",
          m.cancelled);
  counter("dtp_serve_preemptions_total", "Sequences preempted for want of KV blocks (recomputed later).", m.preemptions);
  counter("dtp_serve_kv_blocks_used", "Paged KV cache blocks held by sequences.", m.kv_blocks_used, "gauge");
  counter("dtp_serve_kv_blocks_total", "Paged KV cache blocks.", m.kv_blocks_total, "gauge");
  counter("dtp_serve_kv_block_size_tokens", "Tokens per KV block.", m.kv_block_size, "gauge");
  // vLLM's vllm:prefix_cache_queries and vllm:prefix_cache_hits (--enable-prefix-caching).
  counter("dtp_serve_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", m.prefix_cache_queries);
  counter("dtp_serve_prefix_cache_hits_total", "Prompt tokens found in the prefix cache (not computed again).",
          m.prefix_cache_hits);
  counter("dtp_serve_context_parallel_prefills_total", "Forwards that prefilled sharded over the context-parallel "
          "group (--cp; the others run as replicas).", m.context_parallel_prefills);
  o << m.ttft.text("dtp_serve_time_to_first_token_seconds", "From a request's arrival to its first token.")
    << m.itl.text("dtp_serve_inter_token_latency_seconds", "Between a request's consecutive tokens (a step, or a "
                  "preemption's wait).");
  return o.str();
}

}  // namespace

void add_openai_routes(httplib::Server& server, inference::Engine& engine, const ServedModel& model) {
  server.Post("/v1/completions", [&](const httplib::Request& q, httplib::Response& s) {
    handle(q, s, engine, model, /*chat=*/false);
  });
  server.Post("/v1/chat/completions", [&](const httplib::Request& q, httplib::Response& s) {
    handle(q, s, engine, model, /*chat=*/true);
  });
  server.Get("/v1/models", [&](const httplib::Request&, httplib::Response& s) {
    const json models = {{"object", "list"},
                         {"data", json::array({json{{"id", model.name},
                                                    {"object", "model"},
                                                    {"created", model.created},
                                                    {"owned_by", "dtp"},
                                                    {"max_model_len", model.context}}})}};
    s.set_content(dump(models), "application/json");
  });
  server.Get("/health", [&](const httplib::Request&, httplib::Response& s) {
    const std::string dead = engine.dead();
    if (!dead.empty()) {
      sendError(s, ApiError{503, dead, "server_error", "", ""});
      return;
    }
    s.set_content("{\"status\": \"ok\"}", "application/json");
  });
  server.Get("/metrics", [&](const httplib::Request&, httplib::Response& s) {
    s.set_content(metricsText(engine.metrics()), "text/plain; version=0.0.4");
  });
  server.set_error_handler([](const httplib::Request& q, httplib::Response& s) {
    if (s.status == 404 && s.body.empty()) {
      sendError(s, ApiError{404, "Unknown path " + q.path + ": dtp-serve has /v1/completions, /v1/chat/completions, "
                                 "/v1/models, /health and /metrics.",
                            "invalid_request_error", "", "unknown_url"});
    }
  });
}

}  // namespace dtp::serve
