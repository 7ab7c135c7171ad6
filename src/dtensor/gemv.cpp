// NOTE: [Eigen GEMV]
// The one-row linear's y = W x (decode at batch 1) reads every weight once,
// so its speed is the memory bandwidth it reaches. On one intra-op thread
// (each rank of TP=N when the ranks fill the cores, dtprun's default),
// OpenBLAS 0.3.21's sgemv (at::mv) reached 16-22 GB/s at dim-1024 shapes,
// Eigen's row-major GEMV compiled for AVX2 and FMA 22-25 (docs/benchmarks.md,
// "The GEMV"). On two threads at::mv reached 27-33 and this kernel no more
// than on one: at::parallel_for runs serially in dtp's objects, which are
// not compiled with -fopenmp (ATen's OpenMP loop is inline in its header),
// and building one with it could load a second OpenMP runtime beside the
// pip wheel's bundled one. So gemv() takes Eigen's kernel on one thread
// only, and at::mv keeps the rest. Eigen picks its vector width when it is
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
  gemv_rows_avx2(wp, n, k, stride, xp, yp, bias.defined());
  return y;
}

}  // namespace
#endif

at::Tensor gemv(const at::Tensor& w, const at::Tensor& v, const at::Tensor& bias) {
#if defined(DTP_WITH_EIGEN_AVX2)
  if (cpuHasAvx2Fma() && at::get_num_threads() == 1)
    return w.scalar_type() == at::kFloat ? eigenGemv<float>(w, v, bias) : eigenGemv<double>(w, v, bias);
#endif
  (void)w, (void)v, (void)bias;
  return at::Tensor();
}

}  // namespace dtp::detail
