// What random ops on DTensors draw from, for the techniques that must steer
// or replay it: data parallelism (the batch split over dp) and activation
// checkpointing (the first pass's state, restored for the recomputation).
#pragma once

#include "dtp/process_group.h"

#include <ATen/core/Tensor.h>

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

// Everything random ops on this thread draw from: the DTensor generator
// (with which meshes it was synced on since the last manual_seed, NOTE:
// [Generator sync]), ATen's default CPU generator (plain tensors' dropout)
// and the data-parallel batch.
struct RandomState {
  at::Tensor generator, default_generator;
  std::vector<std::pair<const void*, uint64_t>> synced;
  uint64_t batch_synced_epoch = 0;
  ProcessGroup batch;
};
RandomState get_random_state();
void set_random_state(const RandomState& state);

}  // namespace dtp::detail
