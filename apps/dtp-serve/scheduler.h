// Rank 0's side of dtp-serve: the requests that HTTP threads submit, the
// queue, each step's plan (see NOTE: [Serving step] in engine.h) and what
// each request receives from the tokens the step drew.
#pragma once

#include "engine.h"
#include "histogram.h"
#include "text_stream.h"

#include "dtp/text/tokenizer.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace dtp::serve {

using Clock = std::chrono::steady_clock;

struct Request {
  Request(int64_t id, std::vector<std::string> stops) : id(id), text(std::move(stops)) {}
  // Set by the HTTP thread before submit(), then read-only.
  const int64_t id;
  std::vector<int64_t> prompt;
  SequenceSampling sampling;
  int64_t max_tokens = 16;
  std::vector<int64_t> stop_tokens;  // the sequence ends after one (it adds no text)
  Clock::time_point arrived = Clock::now();

  // The engine thread's alone.
  std::vector<int64_t> text_ids;  // generated ids that decode (no stop token)
  TextStream text;

  // Shared, under `m`.
  std::mutex m;
  std::condition_variable cv;
  std::string pending;            // settled text not yet streamed
  std::vector<int64_t> generated;  // every drawn token, stop token included
  bool done = false;
  std::string finish_reason;      // "stop" or "length"
  int error_status = 0;           // when it failed: the HTTP status, with error_message
  std::string error_message;
  std::string final_text;
  std::optional<Clock::time_point> first_token;
  Clock::time_point last_token;
  std::atomic<bool> cancelled{false};  // the client went away

  // The scheduler's alone.
  int64_t preemptions = 0;  // times its blocks were taken back (it resumes by recomputing)
};

struct Metrics {
  int64_t requests = 0, finished = 0, failed = 0, rejected = 0;
  int64_t prompt_tokens = 0, generation_tokens = 0, steps = 0;
  int64_t waiting = 0, running = 0, cancelled = 0, preemptions = 0;
  int64_t kv_blocks_used = 0, kv_blocks_total = 0, kv_block_size = 0;
  Histogram ttft;  // arrival to first token
  Histogram itl;   // between a request's consecutive tokens
};

class Scheduler {
 public:
  Scheduler(Engine& engine, const models::Tokenizer& tokenizer, std::optional<ProcessGroup> group, int64_t max_queue,
            double shutdown_grace_s);

  enum class Submit { kQueued, kQueueFull, kStopping, kDead };
  // From an HTTP thread: queue `r` for the next steps.
  Submit submit(const std::shared_ptr<Request>& r);
  Metrics metrics() const;
  // Why the engine stopped serving (empty while it serves).
  std::string dead() const;
  // From rank 0's watch (NOTE: [A dead rank] in rank_watch.h): every open
  // request fails with 503 and `why`, and so does every later one.
  void rank_died(const std::string& why);

  // Rank 0's step loop until `stop` is set and the running requests are
  // done (or the grace period ran out); then every rank is told to exit.
  // Returns the exit status: 0, or 1 when a step failed (a rank died).
  int serve(const std::atomic<bool>& stop);

 private:
  StepPlan nextPlan(const std::atomic<bool>& stop);
  void apply(const StepResult& result);
  void pushToken(Request& r, int64_t token);
  void fail(Request& r, int status, const std::string& message);

  Engine& engine_;
  const models::Tokenizer& tokenizer_;
  std::optional<ProcessGroup> group_;
  const int64_t max_queue_;
  const double grace_s_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Request>> waiting_;
  std::vector<std::shared_ptr<Request>> running_;  // in the engine's row order
  bool stopping_ = false;
  Clock::time_point stop_deadline_;
  std::string dead_;
  Metrics metrics_;
};

// The rank != 0 side: follow rank 0's plans until it says to exit. Returns
// the exit status (1 when a step failed).
int follow_plans(Engine& engine, const std::optional<ProcessGroup>& group);

}  // namespace dtp::serve
