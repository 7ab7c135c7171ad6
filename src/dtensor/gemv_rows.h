// The AVX2 rows kernel of dtp::detail::gemv (NOTE: [Eigen GEMV] in gemv.cpp):
// plain C++, no ATen, for gemv_avx2.cpp, which is compiled with -mavx2 -mfma.
#pragma once

#include <cstdint>

namespace dtp::detail {

// y[r] (+)= row r of w . x for r < rows: rows of k values, `stride` apart.
// Call only where the CPU has AVX2 and FMA.
void gemv_rows_avx2(const float* w, int64_t rows, int64_t k, int64_t stride, const float* x, float* y, bool add);
void gemv_rows_avx2(const double* w, int64_t rows, int64_t k, int64_t stride, const double* x, double* y, bool add);

}  // namespace dtp::detail
