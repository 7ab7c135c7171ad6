// Internal: the instruction sets and threads of the weight-only kernel
// (src/nn/quantized_linear.cpp), for tests.
#pragma once

namespace dtp::nn::detail {

// The widest kernel this CPU runs: 0 portable C++, 1 AVX2 + FMA + F16C,
// 2 AVX-512F (float32 inputs; float64 inputs always run the portable loop).
int weight_only_best_isa();

// Run the kernels of `level` (capped at the best), or with -1 the default:
// AVX2 where the CPU has it, even with AVX-512 (NOTE: [AVX2 before
// AVX-512]). Process-wide: for tests and benchmarks, between calls.
void set_weight_only_isa(int level);

// The most intra-op threads one matrix-vector call (at most 8 rows of x)
// ran on since the last call of this, which resets it: 1 where
// at::parallel_for is serial in this build (NOTE: [OpenMP in dtp's kernels]
// in cmake/openmp_kernels.cmake).
int weight_only_threads_seen();

}  // namespace dtp::nn::detail
