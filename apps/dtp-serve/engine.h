// dtp-serve's step loop, run by every rank: rank 0 plans each step (which
// running sequences go on, which waiting requests join) and broadcasts the
// plan; every rank then runs the same forwards and the same sampling.
//
// NOTE: [Serving step] One step is
//   1. drop the rows that finished (KVCache::keep: the batch stays dense);
//   2. decode: one token for every running row, one forward [n, 1];
//   3. prefill: the admitted prompts, right-padded, one forward [k, L] in a
//      separate prefill cache, whose rows are then copied behind the running
//      rows of the main cache (continuous batching on the contiguous
//      KVCache: requests join and leave between decode steps).
// Each row samples with its own generator (seeded by its request), so a
// request draws the same tokens alone or in any batch; greedy rows share one
// sample call. Sampling over vocabulary-sharded logits is collective, and
// every rank holds the same generators, so every rank draws the same tokens
// (rank 0's are used: it sends them as the next step's inputs).
#pragma once

#include "dtp/inference/sampling.h"
#include "dtp/models/kv_cache.h"
#include "dtp/models/llama.h"
#include "dtp/process_group.h"

#include <ATen/core/Generator.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace dtp::serve {

struct SequenceSampling {
  inference::SamplingOptions options;
  uint64_t seed = 0;
};

struct Admission {
  int64_t id = 0;
  SequenceSampling sampling;
  std::vector<int64_t> prompt;
};

struct StepPlan {
  enum Op : int64_t { kIdle = 0, kStep = 1, kShutdown = 2 };
  int64_t op = kIdle;
  std::vector<int64_t> keep;    // rows of the running batch that go on, ascending
  std::vector<int64_t> tokens;  // the input token of each kept row
  std::vector<Admission> admit;
};

std::vector<int64_t> encode_plan(const StepPlan& plan);
StepPlan decode_plan(const std::vector<int64_t>& data);

// Rank 0's `plan` on every rank of `group` (nullopt: one rank). One
// broadcast of a fixed 512-integer block, a second one only for plans that
// do not fit (long prompts).
StepPlan broadcast_plan(const std::optional<ProcessGroup>& group, const StepPlan& plan);

struct StepResult {
  std::vector<int64_t> decoded;  // one per kept row
  std::vector<int64_t> first;    // one per admitted prompt
};

class Engine {
 public:
  // max_batch running sequences of at most `context` tokens each; at most
  // max_prefill prompts join per step.
  Engine(models::Llama& model, int64_t max_batch, int64_t max_prefill, int64_t context);
  // See NOTE: [Serving step]. Collective: every rank runs the same plan.
  StepResult run(const StepPlan& plan);
  int64_t running() const { return static_cast<int64_t>(rows_.size()); }
  int64_t max_batch() const { return max_batch_; }
  int64_t max_prefill() const { return max_prefill_; }
  int64_t context() const { return context_; }

 private:
  struct Row {
    int64_t id;
    inference::SamplingOptions options;
    at::Generator gen;
  };
  std::vector<int64_t> sampleRows(const at::Tensor& logits, std::vector<Row>& rows);
  void joinPrefilled(const std::vector<int64_t>& lengths);

  models::Llama& model_;
  int64_t max_batch_, max_prefill_, context_;
  models::KVCache main_, prefill_;
  at::Tensor like_;  // [1, 1, local KV heads, head_dim]: the layout of a cached key
  std::vector<Row> rows_;
};

}  // namespace dtp::serve
