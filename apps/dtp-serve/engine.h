// dtp-serve's step loop, run by every rank: rank 0 plans each step (which
// running sequences go on, which waiting requests join) and broadcasts the
// plan; every rank then runs the same forwards and the same sampling.
//
// NOTE: [Serving step] The running batch lives in one paged KV cache
// (NOTE: [Paged KV cache] in include/dtp/models/kv_cache.h); each row holds
// its block table. One step is
//   1. rows leave: finished or cancelled ones, and preempted ones (rank 0
//      ran out of blocks; their generators are kept for the resume). Their
//      blocks return to the pool;
//   2. admitted requests join at the end, each with the blocks of its whole
//      prompt (a resumed one: its prompt and the tokens drawn so far, to be
//      recomputed);
//   3. decode: one token for every row done with its prompt, one forward
//      [n, 1]; a row whose blocks are full takes one more first;
//   4. prefill: the next chunk of each row still prefilling (chunk sizes
//      from the plan: at most --prefill-chunk tokens in all per step), one
//      forward [k, longest chunk]; a row whose prompt is done draws its
//      first token.
// So a long prompt is prefilled over several steps while the other rows
// decode one token per step. Rank 0 decides all of it (Scheduler::nextPlan)
// and broadcasts the plan; every rank runs the same allocations in the same
// order, so every rank holds the same block tables.
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

#include "block_pool.h"

#include <ATen/core/Generator.h>

#include <cstdint>
#include <map>
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
  std::vector<int64_t> prompt;  // to prefill: the prompt, or on a resume the prompt and the tokens drawn so far
  bool resume = false;          // preempted before: its generator goes on where it stopped
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

struct StepResult {
  std::vector<int64_t> tokens;  // per row of the batch after the step: its drawn token, or -1 (prompt not done)
};

struct EngineOptions {
  int64_t max_batch = 16;      // running sequences
  int64_t max_prefill = 4;     // sequences in one step's prefill forward
  int64_t prefill_chunk = 256;  // prompt tokens per step, over all sequences
  int64_t context = 0;         // tokens per sequence (prompt + output)
  int64_t block_size = 16;     // tokens per KV block
  int64_t kv_cache_mib = 0;    // the pool's size per rank (0: max_batch sequences of `context`)
  int64_t kv_cache_blocks = 0;  // or in blocks
};

class Engine {
 public:
  Engine(models::Llama& model, const EngineOptions& options);
  // See NOTE: [Serving step]. Collective: every rank runs the same plan.
  StepResult run(const StepPlan& plan);

  struct Row {
    int64_t id;
    inference::SamplingOptions options;
    at::Generator gen;
    std::vector<int64_t> prompt;  // the tokens to prefill
    int64_t cached = 0;           // tokens in the cache
    std::vector<int64_t> blocks;  // its block table
    bool decoding() const { return cached >= static_cast<int64_t>(prompt.size()); }
  };
  // The batch between steps (the same on every rank), for rank 0's planning.
  const std::vector<Row>& rows() const { return rows_; }
  const EngineOptions& options() const { return o_; }
  const BlockPool& blocks() const { return pool_; }
  int64_t blocks_for(int64_t tokens) const { return (tokens + o_.block_size - 1) / o_.block_size; }
  int64_t block_bytes() const { return block_bytes_; }

 private:
  std::vector<int64_t> sampleRows(const at::Tensor& logits, const std::vector<Row*>& rows);
  void admit(const Admission& a);

  models::Llama& model_;
  EngineOptions o_;
  int64_t block_bytes_ = 0;  // K and V of one block over all layers, on this rank
  BlockPool pool_;
  models::KVCache cache_;
  std::vector<Row> rows_;
  std::map<int64_t, at::Generator> preempted_;  // generators of preempted requests, by id
};

}  // namespace dtp::serve
