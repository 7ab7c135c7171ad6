// The leader's side of the engine: the waiting queue, the running batch in
// the runner's row order, and each step's plan (NOTE: [Serving step] in
// model_runner.h). Not thread-safe: Engine calls it under its lock.
#pragma once

#include "dtp/inference/engine.h"

#include "model_runner.h"
#include "step_plan.h"

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <vector>

namespace dtp::inference {

// What the scheduler owns of a request (the client's copy is Engine's
// OutputState, output_processor.h).
struct SchedRequest {
  int64_t id = 0;
  std::vector<int64_t> prompt;
  SequenceSampling sampling;
  int64_t max_tokens = 16;
  std::vector<int64_t> stop_tokens;
  int64_t logprobs = -1;
  std::vector<int64_t> generated;  // every drawn token, a stop token included
  int64_t preemptions = 0;         // times its blocks were taken back (it resumes by recomputing)
  std::atomic<bool> cancelled{false};  // cancel(), from any thread: the row leaves at the next plan
  bool finished = false;               // ended (its row leaves at the next plan)
};

// A token drawn for a request, and whether it ends it (a stop token or
// max_tokens; a stop string is the output side's to find).
struct Drawn {
  std::shared_ptr<SchedRequest> request;
  int64_t token = 0;
  std::optional<TokenLogprobs> logprobs;
  std::optional<FinishReason> finish;
};

class Scheduler {
 public:
  explicit Scheduler(const ModelRunner& runner) : runner_(runner) {}

  void add(std::shared_ptr<SchedRequest> r) { waiting_.push_back(std::move(r)); }
  // The next step's plan from the runner's batch (the same on every rank):
  // rows that finished or were cancelled leave, full rows take a block or
  // preempt the newest, waiting requests join while blocks and the prefill
  // budget allow. kIdle when there is nothing to run.
  StepPlan next_plan();
  // The tokens the step drew, for the running batch after it.
  std::vector<Drawn> update(const StepResult& result);
  // Takes every waiting request out of the queue (a shutdown).
  std::vector<std::shared_ptr<SchedRequest>> drain_waiting();
  const std::vector<std::shared_ptr<SchedRequest>>& running() const { return running_; }
  int64_t waiting() const { return static_cast<int64_t>(waiting_.size()); }
  bool idle() const { return waiting_.empty() && running_.empty(); }
  int64_t preemptions() const { return preemptions_; }

 private:
  const ModelRunner& runner_;
  std::deque<std::shared_ptr<SchedRequest>> waiting_;
  std::vector<std::shared_ptr<SchedRequest>> running_;  // in the runner's row order
  int64_t preemptions_ = 0;
};

}  // namespace dtp::inference
