// Counter-based random numbers for RandomMode::PerShard: the value of element
// i of a draw is a pure function of (seed, stream offset, i), so each rank
// computes its shard's elements only. NOTE: [Per-shard random numbers].
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <array>
#include <cstdint>

namespace dtp::detail {

// NOTE: [Per-shard random numbers]
// A draw fills a tensor of logical shape `shape` (a DTensor's global shape,
// dim 0 times dp under NOTE: [Random ops under data parallelism]); element i
// (row-major index in `shape`, whatever the memory layout) takes its bits
// from one Philox4x32-10 block (Salmon et al. 2011; Random123's constants):
//   counter = (lo32(b), hi32(b), lo32(offset), hi32(offset)), key = (lo32(seed), hi32(seed))
// for block b = i / E, E the elements per block of the draw's kind:
// - Uniform, f32/f16/bf16 (E = 4): word w = i % 4, u = (w >> 8) * 2^-24 in [0, 1).
// - Uniform, f64 (E = 2): words a, b = 2(i % 2), +1,
//   u = ((a >> 5) * 2^26 + (b >> 6)) * 2^-53 in [0, 1).
//   Both: value = u * (to - from) + from in float64, rounded to the dtype.
// - Normal (E = 2, Box-Muller on pairs): u1 = (53 bits of words 0,1 + 1) * 2^-53
//   in (0, 1], u2 = 53 bits of words 2,3 * 2^-53; element 2j is r*cos(2 pi u2),
//   2j+1 is r*sin(2 pi u2), r = sqrt(-2 ln u1), then z * std + mean, rounded
//   to the dtype. ln, cos and sin are our own series of +, *, / and sqrt
//   (philox.cpp), not libm's, so that every device gives the same bits.
// - Bernoulli (E = 4, any dtype): 1 where u < p (u as for f32 uniform).
// Everything is float64 until the final rounding (f16/bf16 through f32),
// with single-rounded +, *, / and sqrt, exact integer steps and no fused
// multiply-add (philox.cpp is compiled with -ffp-contract=off): a CPU loop
// and a sequence of ATen tensor ops (int64 arithmetic on 32-bit words,
// products split into 16-bit halves) give identical bits, so CPU and CUDA
// draws agree. A draw uses ceil(numel / E) blocks; the stream's offset then
// advances by that many on every rank alike, so successive draws use
// distinct counters without communication.

enum class DrawKind { Uniform, Normal, Bernoulli };

struct PhiloxDraw {
  DrawKind kind = DrawKind::Uniform;
  double a = 0, b = 1;  // Uniform: [a, b); Normal: mean a, std b; Bernoulli: p = a
  at::Tensor probs;     // Bernoulli with one probability per element (the box's), else undefined
};

// Philox4x32-10 of `counter` under `key`.
std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

// Elements per Philox block of a draw of `kind` into `dtype`.
int64_t philox_elements_per_block(DrawKind kind, c10::ScalarType dtype);
// Blocks a draw of `numel` elements uses: the stream offset's advance.
uint64_t philox_blocks(DrawKind kind, c10::ScalarType dtype, int64_t numel);

// Fills `out` (contiguous, sizes = the box's) with the elements of a draw
// over `shape` at `box_offset` + [0, out.sizes()). CPU tensors: a parallel
// loop; other devices (or tensor_ops): ATen integer tensor ops in chunks.
void philox_fill(at::Tensor& out, const PhiloxDraw& draw, c10::IntArrayRef shape, c10::IntArrayRef box_offset,
                 uint64_t seed, uint64_t offset, bool tensor_ops = false);

}  // namespace dtp::detail
