// One step of the engine as the leader decides it (NOTE: [Serving step] in
// model_runner.h), and how it reaches the other ranks.
#pragma once

#include "dtp/inference/sampling.h"
#include "dtp/process_group.h"

#include <cstdint>
#include <optional>
#include <vector>

namespace dtp::inference {

struct SequenceSampling {
  SamplingOptions options;
  uint64_t seed = 0;
};

struct Admission {
  int64_t id = 0;
  SequenceSampling sampling;
  std::vector<int64_t> prompt;  // to prefill: the prompt, or on a resume the prompt and the tokens drawn so far
  bool resume = false;          // preempted before: its generator goes on where it stopped
  int64_t logprobs = -1;        // RequestOptions::logprobs
  int64_t cached = 0;           // prompt tokens found in the prefix cache (NOTE: [Prefix cache] in block_pool.h)
};

struct StepPlan {
  enum Op : int64_t { kIdle = 0, kStep = 1, kShutdown = 2 };
  int64_t op = kIdle;
  std::vector<int64_t> keep;     // rows of the running batch that go on, ascending
  std::vector<int64_t> preempt;  // rows that leave to be resumed later, ascending
  std::vector<int64_t> forget;   // ids of preempted requests that will not resume (cancelled)
  std::vector<int64_t> tokens;   // the input token of each kept row done with its prompt, in row order
  std::vector<Admission> admit;  // join behind the kept rows
  std::vector<int64_t> chunks;   // prompt tokens this step of each row still prefilling (kept, then admitted)
};

std::vector<int64_t> encode_plan(const StepPlan& plan);
StepPlan decode_plan(const std::vector<int64_t>& data);

// Rank 0's `plan` on every rank of `group` (nullopt: one rank). One
// broadcast of a fixed 512-integer block, a second one only for plans that
// do not fit (long prompts).
StepPlan broadcast_plan(const std::optional<ProcessGroup>& group, const StepPlan& plan);

}  // namespace dtp::inference
