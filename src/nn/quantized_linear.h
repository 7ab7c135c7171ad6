// Internal: the instruction sets of the weight-only kernel
// (src/nn/quantized_linear.cpp), for tests that run each one.
#pragma once

namespace dtp::nn::detail {

// The widest kernel this CPU runs: 0 portable C++, 1 AVX2 + FMA + F16C,
// 2 AVX-512F (float32 inputs; float64 inputs always run the portable loop).
int weight_only_best_isa();

// Run the kernels of `level` (capped at the best), or the best with -1.
// Process-wide: for tests, between calls.
void set_weight_only_isa(int level);

}  // namespace dtp::nn::detail
