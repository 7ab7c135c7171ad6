#include "openai_api.h"

#include <c10/util/Exception.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
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
  SequenceSampling sampling;
  std::vector<std::string> stop;
  bool stream = false, include_usage = false, return_token_ids = false;
};

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
  if (auto t = number("temperature", 0.0, 2.0, false)) c.sampling.options.temperature = *t;
  if (auto p = number("top_p", 0.0, 1.0, true)) c.sampling.options.top_p = *p;
  if (body.contains("top_k") && body["top_k"].is_number_integer() && body["top_k"].get<int64_t>() == -1) {
    c.sampling.options.top_k = 0;  // vLLM's "no top-k"
  } else if (auto k = integer("top_k", 0)) {
    c.sampling.options.top_k = *k;
  }
  if (body.contains("seed") && !body["seed"].is_null()) {
    if (!body["seed"].is_number_integer()) throw badRequest("seed", "seed: got " + kindOf(body["seed"]) + ", expected an integer.");
    c.sampling.seed = body["seed"].is_number_unsigned() ? body["seed"].get<uint64_t>()
                                                        : static_cast<uint64_t>(body["seed"].get<int64_t>());
  } else {
    static std::atomic<uint64_t> counter{std::random_device{}()};
    c.sampling.seed = counter.fetch_add(0x9E3779B97F4A7C15ULL);
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
  if (body.contains("n") && !body["n"].is_null() && body["n"] != 1) {
    throw badRequest("n", "NYI: n: got " + kindOf(body["n"]) + ", expected 1 (one choice per request).");
  }
  const char* logprobs = "logprobs";
  if (body.contains(logprobs) && !body[logprobs].is_null() && body[logprobs] != false) {
    throw badRequest(logprobs, "NYI: logprobs: got " + kindOf(body[logprobs]) + ", expected null or false.");
  }
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

json usageOf(const Request& r) {
  const int64_t p = static_cast<int64_t>(r.prompt.size()), c = static_cast<int64_t>(r.generated.size());
  return {{"prompt_tokens", p}, {"completion_tokens", c}, {"total_tokens", p + c}};
}

std::atomic<int64_t> gNextId{1};

void handle(const httplib::Request& req, httplib::Response& res, Scheduler& scheduler, const ServedModel& model,
            bool chat) {
  std::shared_ptr<Request> r;
  Common c;
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
    std::vector<int64_t> prompt = chat ? chatIds(body, model) : promptIds(body, model);
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
    r = std::make_shared<Request>(gNextId++, c.stop);
    r->prompt = std::move(prompt);
    r->sampling = c.sampling;
    r->max_tokens = max_tokens;
    r->stop_tokens = chat ? model.chat_stop_tokens : model.stop_tokens;
    switch (scheduler.submit(r)) {
      case Scheduler::Submit::kQueued: break;
      case Scheduler::Submit::kQueueFull:
        throw ApiError{429, "dtp-serve: too many queued requests (--max-queue). Retry later.", "rate_limit_exceeded", "", ""};
      case Scheduler::Submit::kStopping:
        throw ApiError{503, "dtp-serve is shutting down.", "server_error", "", ""};
      case Scheduler::Submit::kDead:
        throw ApiError{503, scheduler.dead(), "server_error", "", ""};
    }
  } catch (const ApiError& e) {
    sendError(res, e);
    return;
  } catch (const std::exception& e) {  // a tokenizer or template error
    sendError(res, badRequest(chat ? "messages" : "prompt", e.what()));
    return;
  }
  const std::string id = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(r->id);
  const int64_t created = unixNow();
  const std::string object = chat ? "chat.completion" : "text_completion";
  if (!c.stream) {
    std::unique_lock<std::mutex> lk(r->m);
    r->cv.wait(lk, [&] { return r->done; });
    if (r->error_status) {
      sendError(res, ApiError{r->error_status, r->error_message, "server_error", "", ""});
      return;
    }
    json choice = {{"index", 0}, {"finish_reason", r->finish_reason}, {"logprobs", nullptr}};
    if (chat) {
      choice["message"] = {{"role", "assistant"}, {"content", r->final_text}};
    } else {
      choice["text"] = r->final_text;
    }
    if (c.return_token_ids) choice["token_ids"] = r->generated;
    json out = {{"id", id}, {"object", object}, {"created", created}, {"model", model.name},
                {"choices", json::array({choice})}, {"usage", usageOf(*r)}};
    if (c.return_token_ids) out["prompt_token_ids"] = r->prompt;
    res.set_content(dump(out), "application/json");
    return;
  }
  // Server-sent events: one chunk per settled piece of text, then the
  // finish reason, the usage if asked, and [DONE].
  auto started = std::make_shared<bool>(false);
  const std::string chunk_object = chat ? "chat.completion.chunk" : "text_completion";
  auto chunk = [=, name = model.name](const json& delta_or_text, const json& finish) {
    json choice = {{"index", 0}, {"finish_reason", finish}, {"logprobs", nullptr}};
    if (chat) {
      choice["delta"] = delta_or_text;
    } else {
      choice["text"] = delta_or_text;
    }
    return json{{"id", id}, {"object", chunk_object}, {"created", created}, {"model", name},
                {"choices", json::array({choice})}};
  };
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [r, c, chat, started, chunk, id, created, chunk_object, name = model.name](size_t, httplib::DataSink& sink) {
        std::unique_lock<std::mutex> lk(r->m);
        r->cv.wait_for(lk, std::chrono::milliseconds(200), [&] { return r->done || !r->pending.empty(); });
        const std::string piece = std::move(r->pending);
        r->pending.clear();
        const bool done = r->done;
        lk.unlock();
        std::string out;
        if (!*started && chat) out += sse(chunk(json{{"role", "assistant"}, {"content", ""}}, nullptr));
        *started = true;
        if (!piece.empty()) out += sse(chunk(chat ? json{{"content", piece}} : json(piece), nullptr));
        if (done) {
          if (r->error_status) {
            out += sse(errorBody(ApiError{r->error_status, r->error_message, "server_error", "", ""}));
          } else {
            json last = chunk(chat ? json::object() : json(""), r->finish_reason);
            if (c.return_token_ids) last["choices"][0]["token_ids"] = r->generated;
            out += sse(last);
            if (c.include_usage) {
              out += sse(json{{"id", id}, {"object", chunk_object}, {"created", created}, {"model", name},
                              {"choices", json::array()}, {"usage", usageOf(*r)}});
            }
          }
          out += "data: [DONE]\n\n";
        }
        if (!out.empty() && !sink.write(out.data(), out.size())) {
          r->cancelled = true;  // the client went away: its row leaves at the next step
          return false;
        }
        if (!sink.is_writable()) {
          r->cancelled = true;
          return false;
        }
        if (done) sink.done();
        return true;
      },
      [r](bool success) {
        if (!success) r->cancelled = true;
      });
}

std::string metricsText(const Metrics& m) {
  std::ostringstream o;
  auto counter = [&](const char* name, const char* help, double v, const char* type = "counter") {
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
  o << m.ttft.text("dtp_serve_time_to_first_token_seconds", "From a request's arrival to its first token.")
    << m.itl.text("dtp_serve_inter_token_latency_seconds", "Between a request's consecutive tokens (a step, or a "
                  "preemption's wait).");
  return o.str();
}

}  // namespace

void add_openai_routes(httplib::Server& server, Scheduler& scheduler, const ServedModel& model) {
  server.Post("/v1/completions", [&](const httplib::Request& q, httplib::Response& s) {
    handle(q, s, scheduler, model, /*chat=*/false);
  });
  server.Post("/v1/chat/completions", [&](const httplib::Request& q, httplib::Response& s) {
    handle(q, s, scheduler, model, /*chat=*/true);
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
    const std::string dead = scheduler.dead();
    if (!dead.empty()) {
      sendError(s, ApiError{503, dead, "server_error", "", ""});
      return;
    }
    s.set_content("{\"status\": \"ok\"}", "application/json");
  });
  server.Get("/metrics", [&](const httplib::Request&, httplib::Response& s) {
    s.set_content(metricsText(scheduler.metrics()), "text/plain; version=0.0.4");
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
