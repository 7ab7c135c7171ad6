// The engine's step, run by every rank: the leader plans each step (which
// running sequences go on, which waiting requests join: scheduler.h) and
// broadcasts the plan (step_plan.h); every rank's ModelRunner then runs the
// same forwards and the same sampling.
//
// NOTE: [Serving step] The running batch lives in one paged KV cache
// (NOTE: [Paged KV cache] in include/dtp/inference/kv_cache.h); each row holds
// its block table. One step is
//   1. rows leave: finished or cancelled ones, and preempted ones (rank 0
//      ran out of blocks; their generators are kept for the resume). Their
//      blocks return to the pool;
//   2. admitted requests join at the end, each with the blocks of its whole
//      prompt (a resumed one: its prompt and the tokens drawn so far, to be
//      recomputed);
//   3. one packed forward (NOTE: [Packed batch] in kv_cache.h, vLLM v1's
//      flattened batch): one token of every row done with its prompt (a
//      row whose blocks are full takes one more first) and the next chunk
//      of each row still prefilling (chunk sizes from the plan: at most
//      EngineOptions::prefill_chunk tokens in all per step), [1, T];
//   4. every row whose prompt is now done draws its next token, in one
//      sampling pass.
// So a long prompt is prefilled over several steps while the other rows
// decode one token per step. The leader decides all of it (Scheduler::next_plan)
// and broadcasts the plan; every rank runs the same allocations in the same
// order, so every rank holds the same block tables.
// Each row samples with its own generator (seeded by its request), so a
// request draws the same tokens alone or in any batch; greedy rows share one
// sample call. Sampling over vocabulary-sharded logits is collective, and
// every rank holds the same generators, so every rank draws the same tokens
// (the leader's are used: it sends them as the next step's inputs).
#pragma once

#include "dtp/inference/engine.h"
#include "dtp/inference/kv_cache.h"
#include "dtp/inference/model.h"

#include "block_pool.h"
#include "step_plan.h"

#include <ATen/core/Generator.h>

#include <cstdint>
#include <map>
#include <optional>
#include <vector>

namespace dtp::inference {

struct StepResult {
  std::vector<int64_t> tokens;  // per row of the batch after the step: its drawn token, or -1 (prompt not done)
  std::vector<std::optional<TokenLogprobs>> logprobs;  // per row: when it drew a token and asked for logprobs
};

class ModelRunner {
 public:
  // `options.context` must be set (Engine fills it in).
  ModelRunner(Model& model, const EngineOptions& options);
  // See NOTE: [Serving step]. Collective: every rank runs the same plan.
  StepResult run(const StepPlan& plan);

  struct Row {
    int64_t id;
    SamplingOptions options;
    int64_t logprobs;  // -1: none
    at::Generator gen;
    std::vector<int64_t> prompt;  // the tokens to prefill
    int64_t cached = 0;           // tokens in the cache
    std::vector<int64_t> blocks;  // its block table
    bool decoding() const { return cached >= static_cast<int64_t>(prompt.size()); }
  };
  // The batch between steps (the same on every rank), for the leader's planning.
  const std::vector<Row>& rows() const { return rows_; }
  const EngineOptions& options() const { return o_; }
  const BlockPool& blocks() const { return pool_; }
  int64_t blocks_for(int64_t tokens) const { return (tokens + o_.block_size - 1) / o_.block_size; }
  int64_t block_bytes() const { return block_bytes_; }
  int64_t local_blocks() const { return cache_.local_blocks(); }

 private:
  // Draws a token for each of `rows` (the rows of `logits`, in order) into
  // result's rows `slots`, with logprobs where asked.
  void sampleRows(const at::Tensor& logits, const std::vector<Row*>& rows, const std::vector<int64_t>& slots,
                  StepResult& result);
  void admit(const Admission& a);
  // One packed forward of `rows` (ascending), `chunk[i]` tokens of row i,
  // and the draws of the rows whose prompt it completes.
  void forwardRows(const std::vector<int64_t>& rows, const std::vector<int64_t>& chunk, const StepPlan& plan,
                   StepResult& result);

  Model& model_;
  EngineOptions o_;
  int64_t block_bytes_ = 0;  // K and V of one block over all layers, on this rank
  c10::Device device_ = c10::Device(c10::kCPU);
  BlockPool pool_;
  KVCache cache_;
  std::vector<Row> rows_;
  std::map<int64_t, at::Generator> preempted_;  // generators of preempted requests, by id
};

}  // namespace dtp::inference
