// NOTE: [Eigen GEMV]
// The one-row linear's y = W x (decode at batch 1) reads every weight once,
// so its speed is the memory bandwidth it reaches. On one intra-op thread
// (each rank of TP=N when the ranks fill the cores, dtprun's default),
// OpenBLAS 0.3.21's sgemv (at::mv) reached 16-22 GB/s at dim-1024 shapes,
// Eigen's row-major GEMV compiled for AVX2 and FMA 22-25 (docs/benchmarks.md,
// "The GEMV"). On more threads gemv() splits W's rows with at::parallel_for,
// which this file runs on libtorch's OpenMP threads (NOTE: [OpenMP in dtp's
// kernels] in cmake/openmp_kernels.cmake); in a build where that loop is
// serial it takes Eigen's kernel on one thread only and leaves the rest to
// at::mv, which has its own threads. Eigen picks its vector width when it is
// compiled, from -mavx2 / -mfma, while dtp is built for baseline x86-64: so
// gemv_avx2.cpp alone is compiled with them (CMakeLists.txt), holds all of
// Eigen (no other object builds Eigen's templates another way) and none of
// ATen, and gemv() calls it only where the CPU reports both
// (__builtin_cpu_supports); elsewhere, or in a build without Eigen, it
// returns undefined and the caller runs at::mv. Profilers see "dtp::gemv"
// (NOTE: [Trace spans]).
#include "dtensor/gemv.h"

#include "comm/trace_span.h"
#include "dtensor/gemv_rows.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <string>

namespace dtp::detail {

#if defined(DTP_WITH_EIGEN_AVX2)
namespace {

bool cpuHasAvx2Fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

template <typename T>
at::Tensor eigenGemv(const at::Tensor& w, const at::Tensor& v, const at::Tensor& bias) {
  const TraceSpan span([] { return std::string("dtp::gemv"); });
  const int64_t n = w.size(0), k = w.size(1), stride = w.stride(0);
  const at::Tensor x = v.contiguous();
  at::Tensor y = bias.defined() ? bias.clone(at::MemoryFormat::Contiguous) : at::empty({n}, w.options());
  const T* wp = w.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  // Blocks of rows of at least 256 KiB of weights a thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / static_cast<int64_t>(k * sizeof(T)));
  at::parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) {
    gemv_rows_avx2(wp + r0 * stride, r1 - r0, k, stride, xp, yp + r0, bias.defined());
  });
  return y;
}

}  // namespace
#endif

at::Tensor gemv(const at::Tensor& w, const at::Tensor& v, const at::Tensor& bias) {
#if defined(DTP_WITH_EIGEN_AVX2)
#if defined(DTP_KERNELS_WITH_OPENMP)
  const bool threads = true;
#else
  const bool threads = at::get_num_threads() == 1;
#endif
  if (cpuHasAvx2Fma() && threads)
    return w.scalar_type() == at::kFloat ? eigenGemv<float>(w, v, bias) : eigenGemv<double>(w, v, bias);
#endif
  (void)w, (void)v, (void)bias;
  return at::Tensor();
}

}  // namespace dtp::detail
