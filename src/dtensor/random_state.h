// What random ops on DTensors draw from, for the techniques that must steer
// or replay it: data parallelism (the batch split over dp) and activation
// checkpointing (the first pass's state, restored for the recomputation).
#pragma once

#include "dtp/process_group.h"

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace dtp::detail {

// Until called again with an invalid group, random ops on DTensors on this
// thread treat dim 0 as a batch split evenly over `dp`, this rank holding
// part dp.rank(): they draw for the whole batch and keep this rank's rows,
// so data-parallel ranks draw what one device draws for the whole batch.
// fully_shard and replicate set it around their module's forward.
// NOTE: [Random ops under data parallelism] in rules/random.cpp.
void set_data_parallel_batch(ProcessGroup dp);
ProcessGroup data_parallel_batch();  // invalid: none set

// A generator given the state of a mesh's (or the dp batch's, who ==
// nullptr) first rank in seed epoch `epoch` (NOTE: [Generator sync]).
struct GeneratorSync {
  const void* who;
  c10::Device device;
  uint64_t epoch;
  bool operator==(const GeneratorSync& o) const { return who == o.who && device == o.device && epoch == o.epoch; }
};

// Everything random ops on this thread draw from: the DTensor generators
// (CPU, and the current GPU's where CUDA is present) with which meshes they
// were synced on since the last manual_seed, ATen's default generators
// (plain tensors' dropout) and the data-parallel batch.
struct RandomState {
  std::vector<std::pair<at::Generator, at::Tensor>> generators;  // each with its state
  std::vector<GeneratorSync> synced;
  ProcessGroup batch;
};
RandomState get_random_state();
void set_random_state(const RandomState& state);

}  // namespace dtp::detail
