// Random ops on DTensors give exactly what one device would give for the same
// seed, whatever the placements (PyTorch does not: pytorch#168058). Two modes,
// per thread (set_random_mode):
//
// RandomMode::Global (the default): every rank draws the whole tensor from the
// same generator state and keeps its shard, so all ranks' generators advance
// identically and the numbers equal ATen's own on one device (mt19937 on CPU)
// bit for bit. The cost is drawing the global tensor on every rank (compute
// O(global numel), memory for one full temporary), with no communication.
//
// RandomMode::PerShard: a counter-based generator (Philox4x32-10, as PyTorch's
// OffsetBasedRNGTracker on CUDA): element i of a draw is a pure function of
// (seed, stream offset, i), so each rank computes only its shard's elements
// (O(local numel), no temporary) and the whole still equals one device, the
// same program on a 1-rank mesh or dtp::per_shard::* on a plain tensor, bit
// for bit, on CPU and CUDA alike (NOTE: [Per-shard random numbers] in
// src/dtensor/philox.h). It cannot equal ATen's plain at::rand/dropout, whose
// CPU generator cannot skip ahead: that is why it is not the default.
// Covered: uniform_, normal_, bernoulli_(p), bernoulli(probs), bernoulli(p),
// native_dropout and dropout, rand_like, randn_like (floating dtypes for the
// uniform and normal ones); an explicit generator argument is an error.
//
// The generator (Global) is the device's (CPU, or the local tensors' GPU)
// default, or the one manual_seed gives this thread for that device (ranks
// running as threads of one process each need their own). On CUDA, dropout
// draws its mask with ATen's CUDA dropout kernel, as one GPU does.
// As PyTorch's, ranks start from one state: the first random op on a mesh
// after each manual_seed (and the first ever) gives every rank the mesh's
// first rank's generator state, or per-shard seed and offset (a broadcast),
// so ranks seeded differently still agree.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <tuple>

namespace dtp {

// Gives this thread its own generator for DTensor random ops, seeded `seed`,
// and its per-shard stream seed `seed` at offset 0.
void manual_seed(uint64_t seed);

enum class RandomMode { Global, PerShard };
// How DTensor random ops on this thread draw (see above). Every rank of a
// mesh must use the same mode.
void set_random_mode(RandomMode mode);
RandomMode random_mode();
// The generator DTensor random ops on `device` draw from: this thread's for
// that device if manual_seed was called on it, else ATen's default for it.
at::Generator random_generator(c10::Device device = c10::kCPU);

// Draws on plain tensors from this thread's per-shard stream, as
// RandomMode::PerShard draws a DTensor of the same shape on a 1-rank mesh:
// the reference a sharded per-shard program equals. Each advances the stream
// as the DTensor op does (no sync: no mesh). Without manual_seed, the stream's
// seed is ATen's default CPU generator's.
namespace per_shard {
at::Tensor& uniform_(at::Tensor& self, double from = 0, double to = 1);
at::Tensor& normal_(at::Tensor& self, double mean = 0, double std = 1);
at::Tensor& bernoulli_(at::Tensor& self, double p = 0.5);
at::Tensor bernoulli(const at::Tensor& probs);
at::Tensor bernoulli(const at::Tensor& self, double p);
at::Tensor rand_like(const at::Tensor& self);
at::Tensor randn_like(const at::Tensor& self);
// (output, keep mask), as at::native_dropout(input, p, /*train=*/true).
std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p);
// As at::dropout(input, p, /*train=*/true) on a DTensor: ATen runs
// native_dropout on CUDA and empty_like(input).bernoulli_(1 - p), div_(1 - p),
// input * noise elsewhere (different roundings), and so does this.
at::Tensor dropout(const at::Tensor& input, double p);
}  // namespace per_shard

}  // namespace dtp
