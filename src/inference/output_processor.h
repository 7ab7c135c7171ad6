// The engine's output side: what each request's client gets from the
// tokens a step drew (new tokens, the text they settle, a stop string, the
// finish), and the latency metrics. Runs on the stepping thread, after the
// step; the outputs are handed to callbacks or poll() by Engine.
#pragma once

#include "dtp/inference/engine.h"
#include "dtp/text/decode_stream.h"

#include "scheduler.h"
#include "text_stream.h"

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

namespace dtp::inference {

using Clock = std::chrono::steady_clock;

// What the output side owns of a request.
struct OutputState {
  OutputState(int64_t id, const RequestOptions& o, int64_t prompt_tokens, OutputCallback cb)
      : id(id), stop_tokens(o.stop_tokens), skip_special_tokens(o.skip_special_tokens),
        prompt_tokens(prompt_tokens), callback(std::move(cb)), text(o.stop) {}
  const int64_t id;
  const std::vector<int64_t> stop_tokens;
  const bool skip_special_tokens;
  const int64_t prompt_tokens;
  OutputCallback callback;  // empty: outputs go to poll()
  Clock::time_point arrived = Clock::now();
  std::optional<Clock::time_point> first_token;
  Clock::time_point last_token;
  int64_t completion_tokens = 0;
  std::unique_ptr<models::DecodeStream> decoder;  // with a tokenizer: the drawn ids that decode
  TextStream text;
};

class OutputProcessor {
 public:
  explicit OutputProcessor(const models::Tokenizer* tokenizer) : tokenizer_(tokenizer) {}

  void add(std::shared_ptr<OutputState> s);
  bool has(int64_t id) const { return states_.count(id) > 0; }
  // The outputs of one step's tokens, one per request that drew some. A
  // stop string finishes its request (`Drawn::request->finished`). Finished
  // requests are forgotten. ttft and itl observe each token.
  std::vector<std::pair<std::shared_ptr<OutputState>, Output>> process(const std::vector<Drawn>& drawn, Histogram& ttft,
                                                                       Histogram& itl);
  // A request's last output when it ends without a token (cancelled,
  // failed); nullopt when it already ended.
  std::optional<std::pair<std::shared_ptr<OutputState>, Output>> end(int64_t id, FinishReason reason,
                                                                     const std::string& error = "");

 private:
  const models::Tokenizer* tokenizer_;
  std::map<int64_t, std::shared_ptr<OutputState>> states_;
};

}  // namespace dtp::inference
