// What random ops on DTensors draw from, for the techniques that must steer
// or replay it: data parallelism (the batch split over dp) and activation
// checkpointing (the first pass's state, restored for the recomputation).
// The state lives in random_state.cpp; the random-op handlers that draw from
// it are rules (rules/random.cpp).
#pragma once

#include "dtensor/philox.h"
#include "dtp/process_group.h"
#include "dtp/random.h"

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dtp {
class DeviceMesh;
}

namespace dtp::detail {

// Until called again with an invalid group, random ops on DTensors on this
// thread treat dim 0 as a batch split evenly over `dp`, this rank holding
// part dp.rank(): they draw for the whole batch and keep this rank's rows,
// so data-parallel ranks draw what one device draws for the whole batch.
// fully_shard and replicate set it around their module's forward.
// NOTE: [Random ops under data parallelism] in rules/random.cpp.
void set_data_parallel_batch(ProcessGroup dp);
ProcessGroup data_parallel_batch();  // invalid: none set

// The generator random ops on `mesh` draw from on `device` (dtp::random_generator),
// given the mesh's first rank's state (and the dp batch's first rank's, under
// set_data_parallel_batch) once per seed epoch: NOTE: [Generator sync].
at::Generator synced_generator(const DeviceMesh& mesh, c10::Device device);

// The per-shard stream's seed and offset for one draw (NOTE: [Per-shard
// random numbers] in philox.h).
struct PhiloxState {
  uint64_t seed = 0;
  uint64_t offset = 0;
};
// This thread's per-shard stream for a draw of `blocks` Philox blocks, given
// the mesh's first rank's seed and offset once per seed epoch (and the dp
// batch's, under set_data_parallel_batch; mesh == nullptr: plain tensors, no
// sync); the stream's offset then advances by `blocks`.
PhiloxState take_philox(const DeviceMesh* mesh, uint64_t blocks);

// Fills `out` (contiguous, the box's sizes) with `op`'s per-shard draw over
// `shape` at `box_offset`, from take_philox(mesh, the draw's blocks); checks
// what `op` can draw (dtype, bounds). Defined in per_shard_random.cpp.
void draw_per_shard(const std::string& op, at::Tensor& out, const PhiloxDraw& draw, c10::IntArrayRef shape,
                    c10::IntArrayRef box_offset, const DeviceMesh* mesh);

// A generator, or the per-shard stream (device kMeta), given the state of a
// mesh's (or the dp batch's, who == nullptr) first rank in seed epoch `epoch`
// (NOTE: [Generator sync]).
struct GeneratorSync {
  const void* who;
  c10::Device device;
  uint64_t epoch;
  bool operator==(const GeneratorSync& o) const { return who == o.who && device == o.device && epoch == o.epoch; }
};

// Everything random ops on this thread draw from: the DTensor generators
// (CPU, and the current GPU's where CUDA is present) with which meshes they
// were synced on since the last manual_seed, ATen's default generators
// (plain tensors' dropout), the mode and per-shard stream, and the
// data-parallel batch.
struct RandomState {
  std::vector<std::pair<at::Generator, at::Tensor>> generators;  // each with its state
  std::vector<GeneratorSync> synced;
  ProcessGroup batch;
  RandomMode mode = RandomMode::Global;
  std::optional<PhiloxState> philox;  // unset until first used or seeded
};
RandomState get_random_state();
void set_random_state(const RandomState& state);

}  // namespace dtp::detail
