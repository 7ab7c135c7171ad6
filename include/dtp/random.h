// Random ops on DTensors give exactly what one device would give for the same
// seed, whatever the placements (PyTorch does not: pytorch#168058).
//
// How: every rank draws the whole tensor from the same generator state and
// keeps its shard, so all ranks' generators advance identically and the
// numbers match a single-device run bit for bit. The cost is drawing the
// global tensor on every rank (compute O(global numel), memory for one full
// temporary), with no communication. A cheaper per-shard mode is NYI: the CPU
// generator (mt19937) cannot skip ahead to a shard's offset.
//
// The generator is the default CPU generator, or the one set by manual_seed on
// this thread (ranks running as threads of one process each need their own).
// As PyTorch's, ranks start from one state: the first random op on a mesh
// after each manual_seed (and the first ever) gives every rank the mesh's
// first rank's generator state (a broadcast), so ranks seeded differently
// still agree.
#pragma once

#include <ATen/core/Generator.h>

#include <cstdint>

namespace dtp {

// Gives this thread its own generator for DTensor random ops, seeded `seed`.
void manual_seed(uint64_t seed);
// This thread's generator if manual_seed was called on it, else ATen's default.
at::Generator random_generator();

}  // namespace dtp
