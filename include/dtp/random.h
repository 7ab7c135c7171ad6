// Random ops on DTensors give exactly what one device would give for the same
// seed, whatever the placements (PyTorch does not: pytorch#168058).
//
// How: every rank draws the whole tensor from the same generator state and
// keeps its shard, so all ranks' generators advance identically and the
// numbers match a single-device run bit for bit. The cost is drawing the
// global tensor on every rank (compute O(global numel), memory for one full
// temporary), with no communication. A cheaper per-shard mode is NYI: the CPU
// generator (mt19937) cannot skip ahead to a shard's offset (CUDA's Philox
// could, as PyTorch's offset-based tracker does).
//
// The generator is the device's (CPU, or the local tensors' GPU) default, or
// the one manual_seed gives this thread for that device (ranks running as
// threads of one process each need their own). On CUDA, dropout draws its
// mask with ATen's CUDA dropout kernel, as one GPU does.
// As PyTorch's, ranks start from one state: the first random op on a mesh
// after each manual_seed (and the first ever) gives every rank the mesh's
// first rank's generator state (a broadcast), so ranks seeded differently
// still agree.
#pragma once

#include <ATen/core/Generator.h>
#include <c10/core/Device.h>

#include <cstdint>

namespace dtp {

// Gives this thread its own generator for DTensor random ops, seeded `seed`.
void manual_seed(uint64_t seed);
// The generator DTensor random ops on `device` draw from: this thread's for
// that device if manual_seed was called on it, else ATen's default for it.
at::Generator random_generator(c10::Device device = c10::kCPU);

}  // namespace dtp
