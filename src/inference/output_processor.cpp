#include "output_processor.h"

#include "dtp/text/tokenizer.h"

#include <algorithm>

namespace dtp::inference {

void OutputProcessor::add(std::shared_ptr<OutputState> s) {
  if (tokenizer_ != nullptr) s->decoder = std::make_unique<models::DecodeStream>(*tokenizer_, s->skip_special_tokens);
  states_[s->id] = std::move(s);
}

std::vector<std::pair<std::shared_ptr<OutputState>, Output>> OutputProcessor::process(const std::vector<Drawn>& drawn,
                                                                                      Histogram& ttft, Histogram& itl) {
  std::vector<std::pair<std::shared_ptr<OutputState>, Output>> out;
  const Clock::time_point now = Clock::now();
  for (const Drawn& d : drawn) {
    auto it = states_.find(d.request->id);
    TORCH_INTERNAL_ASSERT(it != states_.end());
    OutputState& s = *it->second;
    if (!s.first_token) {
      s.first_token = now;
      ttft.observe(std::chrono::duration<double>(now - s.arrived).count());
    } else {
      itl.observe(std::chrono::duration<double>(now - s.last_token).count());
    }
    s.last_token = now;
    ++s.completion_tokens;
    Output o;
    o.id = s.id;
    o.tokens = {d.token};
    if (d.logprobs) o.logprobs = {*d.logprobs};
    o.prompt_tokens = s.prompt_tokens;
    o.completion_tokens = s.completion_tokens;
    std::optional<FinishReason> finish = d.finish;
    if (tokenizer_ != nullptr) {
      const bool stop_token = std::find(s.stop_tokens.begin(), s.stop_tokens.end(), d.token) != s.stop_tokens.end();
      // Ids past the tokenizer's vocabulary (a model's padded vocabulary)
      // add no text, as in dtp-generate; a stop token adds none either.
      if (!stop_token && d.token < tokenizer_->vocab_size()) s.text.append(s.decoder->step(d.token));
      if (s.text.stopped()) {
        finish = FinishReason::kStop;
        d.request->finished = true;  // its row leaves at the next plan
      }
      if (finish) {
        s.text.append(s.decoder->flush());
        s.text.finish();
      }
      o.text = s.text.take();
    }
    if (finish) {
      o.finished = true;
      o.finish_reason = *finish;
    }
    out.emplace_back(it->second, std::move(o));
    if (finish) states_.erase(it);
  }
  return out;
}

std::optional<std::pair<std::shared_ptr<OutputState>, Output>> OutputProcessor::end(int64_t id, FinishReason reason,
                                                                                  const std::string& error) {
  auto it = states_.find(id);
  if (it == states_.end()) return std::nullopt;
  OutputState& s = *it->second;
  Output o;
  o.id = id;
  o.prompt_tokens = s.prompt_tokens;
  o.completion_tokens = s.completion_tokens;
  o.finished = true;
  o.finish_reason = reason;
  o.error = error;
  if (tokenizer_ != nullptr) {
    s.text.append(s.decoder->flush());
    s.text.finish();
    o.text = s.text.take();  // the held-back tail
  }
  auto state = it->second;
  states_.erase(it);
  return std::make_pair(std::move(state), std::move(o));
}

}  // namespace dtp::inference
