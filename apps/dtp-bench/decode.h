// dtp-bench --decode: per-token decode latency of the reference Llama with a
// KV cache (greedy, float32, no grad), dtp against a hand-written decode on
// the same weights, interleaved rep by rep:
//   tp=1          (one rank only) dtp's model on plain tensors against the
//                 same decode written in plain libtorch;
//   tp=1, W > 1   the same on rank 0 alone with all the job's threads (the
//                 other ranks wait): TP=1 and TP=W side by side in one run
//   tp=W          dtp's model after apply_tensor_parallel_for_inference
//                 against a gpt-fast-style decode on each rank's local shards
//                 with the same collectives (one all-reduce after the
//                 embedding, each attention and each MLP; one all-gather of
//                 [B, 2] per rank for the greedy pick). On one rank this is
//                 DTensor's cost alone: a one-rank mesh moves nothing.
// On the CPU with W > 1, the tp=W rows run twice: CPU collectives through
// shared memory (shm, NOTE: [Shared-memory collectives]) and Gloo alone.
// Exits non-zero when the hand-written decode picks other tokens than dtp's,
// or issues other collectives: then it would not be a fair baseline.
#pragma once

#include "dtp/nn/quantize.h"
#include "dtp/process_group.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dtp::bench {

struct DecodeOptions {
  int reps = 5, warmup = 1;
  int64_t prompt = 32, steps = 32;  // prompt tokens (prefill, untimed); decode steps timed
  std::vector<int64_t> batches{1, 8};
  std::vector<std::string> sizes{"d256", "d512", "d1024"};  // of decode_size_names()
  std::string device = "cpu";                                // cpu, or cuda (GPU LOCAL_RANK)
  // --dtype / --quantize (dtp-generate's flags): the computation's dtype and
  // the Linear weights' storage (models::to_weight_only), for both decoders.
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::optional<nn::WeightOnlyOptions> weight_only;
  std::string weights = "float32";  // the table's label
};

// The model sizes --decode knows: d64 (a smoke test), d256, d512, d1024.
std::vector<std::string> decode_size_names();

// Prints the table on rank 0; false (on every rank) when a check failed.
bool run_decode(const DecodeOptions& options, const ProcessGroup& world);

}  // namespace dtp::bench
