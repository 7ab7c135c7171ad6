// Eigen's row-major GEMV built for AVX2 and FMA (NOTE: [Eigen GEMV] in
// gemv.cpp). This file is compiled with -mavx2 -mfma and includes Eigen and
// nothing of ATen, so that no inline ATen code is built for AVX2 here.
#include "dtensor/gemv_rows.h"

#include <Eigen/Core>

namespace dtp::detail {

namespace {

template <typename T>
void rowsTimes(const T* w, int64_t rows, int64_t k, int64_t stride, const T* x, T* y, bool add) {
  using Rows = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>, 0,
                          Eigen::OuterStride<>>;
  using Vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;
  const Rows m(w, rows, k, Eigen::OuterStride<>(stride));
  const Eigen::Map<const Vector> in(x, k);
  Eigen::Map<Vector> out(y, rows);
  if (add) out.noalias() += m * in;
  else out.noalias() = m * in;
}

}  // namespace

void gemv_rows_avx2(const float* w, int64_t rows, int64_t k, int64_t stride, const float* x, float* y, bool add) {
  rowsTimes(w, rows, k, stride, x, y, add);
}
void gemv_rows_avx2(const double* w, int64_t rows, int64_t k, int64_t stride, const double* x, double* y, bool add) {
  rowsTimes(w, rows, k, stride, x, y, add);
}

}  // namespace dtp::detail
