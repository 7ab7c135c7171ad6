// Weight-only Linear layers: the ops dtp::weight_only_linear and
// dtp::int8_weight_only_linear, their CPU kernel and sharding rule, and the
// conversion of a Linear. See NOTE: [Weight-only linears] in
// include/dtp/nn/quantize.h.
#include "dtp/nn/quantize.h"
#include "nn/quantized_linear.h"

#include "dtp/dtensor.h"
#include "dtp/module_utils.h"
#include "dtp/register_sharding.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>

namespace dtp::nn {
namespace {

constexpr int64_t kGemvRows = 8;     // rows of x up to which the kernel is a matrix-vector product
constexpr int64_t kBlockRows = 64;   // weight rows widened at a time above that

bool isNarrowFloat(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// ---- The widened dot products of one weight row with one row of x. ----

template <class W>
inline float widen(W v) {
  return static_cast<float>(v);
}

// x . w over [0, k) in T (float or double), scalar: the portable path and
// the float64 one.
template <class T, class W>
T dotScalar(const T* x, const W* w, int64_t k) {
  T acc = 0;
  for (int64_t i = 0; i < k; ++i) acc += x[i] * static_cast<T>(widen(w[i]));
  return acc;
}

// One output element: row `w` (k inputs) against `x`, with `groups` scales
// (0: none; 1: one for the row; else one per k / groups inputs).
template <class T, class W>
T rowScalar(const T* x, const W* w, const float* s, int64_t k, int64_t groups) {
  if (groups == 0) return dotScalar(x, w, k);
  if (groups == 1) return dotScalar(x, w, k) * static_cast<T>(s[0]);
  const int64_t gs = k / groups;
  T acc = 0;
  for (int64_t g = 0; g < groups; ++g) acc += static_cast<T>(s[g]) * dotScalar(x + g * gs, w + g * gs, gs);
  return acc;
}

#if defined(__x86_64__) && defined(__GNUC__)
#define DTP_AVX2 __attribute__((target("avx2,fma,f16c")))

DTP_AVX2 inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
DTP_AVX2 inline __m256 load8(const c10::BFloat16* p) {  // bf16 is float's top half
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
DTP_AVX2 inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
DTP_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// x . w over [0, k): four independent accumulators of 8 lanes.
template <class W>
DTP_AVX2 float dotAvx2(const float* x, const W* w, int64_t k) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), load8(w + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), load8(w + i + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), load8(w + i + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), load8(w + i + 24), a3);
  }
  for (; i + 8 <= k; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), load8(w + i), a0);
  float acc = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < k; ++i) acc += x[i] * widen(w[i]);
  return acc;
}

// One group of 32 (Q8_0's block): its products summed in two independent chains.
DTP_AVX2 inline __m256 group32(const float* x, const int8_t* w) {
  __m256 p0 = _mm256_mul_ps(_mm256_loadu_ps(x), load8(w));
  __m256 p1 = _mm256_mul_ps(_mm256_loadu_ps(x + 8), load8(w + 8));
  p0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), load8(w + 16), p0);
  p1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), load8(w + 24), p1);
  return _mm256_add_ps(p0, p1);
}

// The int8 groups' kernels ask for the weight bytes 512 ahead (a software
// prefetch each two groups, past the row's end too: a hint, never a fault).
// Measured with the AVX-512 kernel (1 thread, 1B shapes, dtp_decode_profile
// --gemv, read from memory): the head 11.3-12.2 -> 15.2 GB/s, gate/up
// 12.8-13.1 -> 17.1; 1024 and more bytes ahead gained less. The widening
// costs more instructions per byte than bf16's, and the hardware prefetcher
// alone ran behind.
constexpr int64_t kInt8Ahead = 512;

// Groups of 32, each scaled into one of two running totals (alternating).
DTP_AVX2 float groups32Avx2(const float* x, const int8_t* w, const float* s, int64_t groups) {
  __m256 t0 = _mm256_setzero_ps(), t1 = t0;
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(w + g * 32 + kInt8Ahead), _MM_HINT_T0);
    t0 = _mm256_fmadd_ps(_mm256_set1_ps(s[g]), group32(x + g * 32, w + g * 32), t0);
    t1 = _mm256_fmadd_ps(_mm256_set1_ps(s[g + 1]), group32(x + (g + 1) * 32, w + (g + 1) * 32), t1);
  }
  if (g < groups) t0 = _mm256_fmadd_ps(_mm256_set1_ps(s[g]), group32(x + g * 32, w + g * 32), t0);
  return hsum(_mm256_add_ps(t0, t1));
}

template <class W>
DTP_AVX2 float rowAvx2(const float* x, const W* w, const float* s, int64_t k, int64_t groups) {
  if (groups == 0) return dotAvx2(x, w, k);
  if (groups == 1) return dotAvx2(x, w, k) * s[0];
  const int64_t gs = k / groups;
  if constexpr (std::is_same_v<W, int8_t>) {
    if (gs == 32) return groups32Avx2(x, w, s, groups);
  }
  float acc = 0;
  for (int64_t g = 0; g < groups; ++g) acc += s[g] * dotAvx2(x + g * gs, w + g * gs, gs);
  return acc;
}

// NOTE: [Four weight rows at a time] Where x is as large as the L1 data
// cache (k = 8192 float32 inputs, 32 KiB: Llama-3.2-1B's down projection),
// the one-row kernel reloads x from L2 for every weight row, and halved its
// bandwidth there: bf16 12.3 GB/s against 26-29 at k = 2048 (1 thread,
// dtp_decode_profile --gemv, 1B shapes). There each x load serves four
// weight rows, one accumulator each: 18-21 GB/s bf16, int8 (groups of 32)
// 9.7 -> 13-16. On shorter rows four rows at a time lost (k = 1024-2048:
// bf16 28 -> 13-19 GB/s from memory; k = 4096 bf16 28 -> 21, int8 12.5 ->
// 15), so they keep one row at a time. Rows go in blocks of four from row
// 0 whatever the thread split (gemvRows' callers), so each output is the
// same sum on any number of threads. AVX2 only: the AVX-512 kernels lost
// here (NOTE: [AVX2 before AVX-512]), and an AVX-512 CPU runs these.

// Rows of at least this many inputs (x of 32 KiB) run four at a time, where
// the kernels below have that form: no scales, one per row, or int8 in
// groups of 32.
constexpr int64_t kFourRowsMinInputs = 8192;

template <class W>
bool hasFourRowForm(int64_t k, int64_t groups) {
  return k >= kFourRowsMinInputs &&
         (groups == 0 || groups == 1 || (std::is_same_v<W, int8_t> && k == groups * 32));
}

template <class W>
DTP_AVX2 void dot4Avx2(const float* x, const W* w, int64_t k, float* out) {  // rows k apart
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    for (int r = 0; r < 4; ++r) a[r] = _mm256_fmadd_ps(xv, load8(w + r * k + i), a[r]);
  }
  for (int r = 0; r < 4; ++r) {
    float acc = hsum(a[r]);
    for (int64_t j = i; j < k; ++j) acc += x[j] * widen(w[r * k + j]);
    out[r] = acc;
  }
}

DTP_AVX2 void groups32x4Avx2(const float* x, const int8_t* w, const float* s, int64_t groups, float* out) {
  __m256 t[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * 32;
    const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8), x2 = _mm256_loadu_ps(xg + 16),
                 x3 = _mm256_loadu_ps(xg + 24);
    for (int r = 0; r < 4; ++r) {
      const int8_t* p = w + r * groups * 32 + g * 32;
      __m256 p0 = _mm256_mul_ps(x0, load8(p)), p1 = _mm256_mul_ps(x1, load8(p + 8));
      p0 = _mm256_fmadd_ps(x2, load8(p + 16), p0);
      p1 = _mm256_fmadd_ps(x3, load8(p + 24), p1);
      t[r] = _mm256_fmadd_ps(_mm256_set1_ps(s[r * groups + g]), _mm256_add_ps(p0, p1), t[r]);
    }
  }
  for (int r = 0; r < 4; ++r) out[r] = hsum(t[r]);
}

// Four rows' outputs, where hasFourRowForm.
template <class W>
DTP_AVX2 void rows4Avx2(const float* x, const W* w, int64_t k, const float* s, int64_t groups, float* out) {
  if (groups == 0 || groups == 1) {
    dot4Avx2(x, w, k, out);
    if (groups == 1)
      for (int r = 0; r < 4; ++r) out[r] *= s[r];
    return;
  }
  if constexpr (std::is_same_v<W, int8_t>) groups32x4Avx2(x, w, s, groups, out);
}

#define DTP_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

DTP_AVX512 inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
DTP_AVX512 inline __m512 load16(const c10::BFloat16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
DTP_AVX512 inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <class W>
DTP_AVX512 float dotAvx512(const float* x, const W* w, int64_t k) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), load16(w + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), load16(w + i + 16), a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 32), load16(w + i + 32), a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 48), load16(w + i + 48), a3);
  }
  for (; i + 16 <= k; i += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), load16(w + i), a0);
  float acc = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  for (; i < k; ++i) acc += x[i] * widen(w[i]);
  return acc;
}

DTP_AVX512 inline __m512 group32x16(const float* x, const int8_t* w) {
  const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(x), load16(w));
  return _mm512_fmadd_ps(_mm512_loadu_ps(x + 16), load16(w + 16), p);
}

DTP_AVX512 float groups32Avx512(const float* x, const int8_t* w, const float* s, int64_t groups) {
  __m512 t0 = _mm512_setzero_ps(), t1 = t0;
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(w + g * 32 + kInt8Ahead), _MM_HINT_T0);
    t0 = _mm512_fmadd_ps(_mm512_set1_ps(s[g]), group32x16(x + g * 32, w + g * 32), t0);
    t1 = _mm512_fmadd_ps(_mm512_set1_ps(s[g + 1]), group32x16(x + (g + 1) * 32, w + (g + 1) * 32), t1);
  }
  if (g < groups) t0 = _mm512_fmadd_ps(_mm512_set1_ps(s[g]), group32x16(x + g * 32, w + g * 32), t0);
  return _mm512_reduce_add_ps(_mm512_add_ps(t0, t1));
}

template <class W>
DTP_AVX512 float rowAvx512(const float* x, const W* w, const float* s, int64_t k, int64_t groups) {
  if (groups == 0) return dotAvx512(x, w, k);
  if (groups == 1) return dotAvx512(x, w, k) * s[0];
  const int64_t gs = k / groups;
  if constexpr (std::is_same_v<W, int8_t>) {
    if (gs == 32) return groups32Avx512(x, w, s, groups);
  }
  float acc = 0;
  for (int64_t g = 0; g < groups; ++g) acc += s[g] * dotAvx512(x + g * gs, w + g * gs, gs);
  return acc;
}

int detectIsa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;  // F16C comes with AVX2
  return 0;
}
#else
int detectIsa() { return 0; }
#endif

// See detail::set_weight_only_isa in src/nn/quantized_linear.h.
std::atomic<int> forcedIsa{-1};
// See detail::weight_only_threads_seen: the most threads one call's
// matrix-vector rows ran on since the last read.
std::atomic<int> threadsSeen{0};

void noteThread() {
  const int t = at::get_thread_num() + 1;
  int seen = threadsSeen.load(std::memory_order_relaxed);
  while (t > seen && !threadsSeen.compare_exchange_weak(seen, t, std::memory_order_relaxed)) {
  }
}

// NOTE: [AVX2 before AVX-512] The kernels run AVX2 by default, AVX-512
// only when asked (set_weight_only_isa(2)): on the one AVX-512 CPU measured
// (AMD EPYC, Zen 4, which runs 512-bit vectors as two halves; 1 thread, 1B
// shapes read from memory, dtp_decode_profile --gemv, two runs each) the
// AVX2 int8 kernel read 19.3-21.8 GB/s on the head and 19.8-22.2 on gate/up
// where AVX-512's read 13.3-13.4 and 13.9-14.4, and bf16 was level or
// better (24.7-30.9 against 24.8-28.8). Untested on CPUs with full-width
// AVX-512.
int activeIsa() {
  static const int best = detectIsa();
  const int forced = forcedIsa.load(std::memory_order_relaxed);
  return forced < 0 ? std::min(best, 1) : std::min(forced, best);
}

// The scales of weight rows [r, r + rows) (`per` each) as float32: in place,
// or float16 ones widened into `buf` (NOTE: [Float16 scales]). Once per row,
// not per group: widening each group's scale inside the kernels ran most
// shapes 5-10% slower (1 thread, 1B shapes, dtp_decode_profile --gemv).
inline const float* rowScales(const float* s, int64_t per, int64_t r, int64_t, std::vector<float>&) {
  return s == nullptr ? nullptr : s + r * per;
}
#if defined(__x86_64__) && defined(__GNUC__)
// Widens the first n / 8 * 8 of n float16 values; returns how many.
DTP_AVX2 int64_t widenHalfAvx2(const c10::Half* s, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, load8(s + i));
  return i;
}
#endif
inline const float* rowScales(const c10::Half* s, int64_t per, int64_t r, int64_t rows, std::vector<float>& buf) {
  const int64_t n = per * rows;
  buf.resize(static_cast<size_t>(n));
  const c10::Half* from = s + r * per;
  int64_t i = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  if (activeIsa() > 0) i = widenHalfAvx2(from, n, buf.data());
#endif
  for (; i < n; ++i) buf[i] = widen(from[i]);
  return buf.data();
}

// y[m, n] for m < rows of x (at most kGemvRows), weight rows [n0, n1): each
// weight row is read once and used for every row of x while in cache; four
// rows at a time where the kernel has that form (NOTE: [Four weight rows at
// a time]: n0 is a multiple of 4).
template <class T, class W, class S>
void gemvRows(const T* x, int64_t m, int64_t k, const W* w, const S* s, int64_t groups, T* y, int64_t n,
              int64_t n0, int64_t n1) {
  const int64_t sStride = std::max<int64_t>(groups, 0);
  const int isa = activeIsa();
  std::vector<float> sbuf;
  int64_t r = n0;
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (std::is_same_v<T, float>) {
    float out[4];
    const bool four = isa > 0 && hasFourRowForm<W>(k, groups);
    for (; four && r + 4 <= n1; r += 4) {
      const W* rows = w + r * k;
      const float* rs = rowScales(s, sStride, r, 4, sbuf);
      for (int64_t i = 0; i < m; ++i) {
        rows4Avx2(x + i * k, rows, k, rs, groups, out);  // AVX2 only (NOTE: [AVX2 before AVX-512])
        for (int j = 0; j < 4; ++j) y[i * n + r + j] = out[j];
      }
    }
  }
#endif
  for (; r < n1; ++r) {
    const W* row = w + r * k;
    const float* rs = rowScales(s, sStride, r, 1, sbuf);
    for (int64_t i = 0; i < m; ++i) {
#if defined(__x86_64__) && defined(__GNUC__)
      if constexpr (std::is_same_v<T, float>) {
        if (isa == 2) {
          y[i * n + r] = rowAvx512(x + i * k, row, rs, k, groups);
          continue;
        }
        if (isa == 1) {
          y[i * n + r] = rowAvx2(x + i * k, row, rs, k, groups);
          continue;
        }
      }
#endif
      y[i * n + r] = rowScalar(x + i * k, row, rs, k, groups);
    }
  }
}

// Rows [n0, n0 + rows) of the weight widened (and scaled) into `out` [rows, k] of T.
template <class T, class W, class S>
void widenRows(const W* w, const S* s, int64_t groups, int64_t k, int64_t n0, int64_t rows, T* out) {
  const int64_t gs = groups > 0 ? k / groups : k;
  for (int64_t r = 0; r < rows; ++r) {
    const W* row = w + (n0 + r) * k;
    T* o = out + r * k;
    for (int64_t i = 0; i < k; ++i) {
      const T v = static_cast<T>(widen(row[i]));
      o[i] = groups == 0 ? v : v * static_cast<T>(widen(s[(n0 + r) * groups + i / gs]));
    }
  }
}

template <class T, class W, class S>
void linearLocal(const at::Tensor& x2, const at::Tensor& w, const at::Tensor& s, int64_t groups, at::Tensor& y) {
  const int64_t m = x2.size(0), k = x2.size(1), n = w.size(0);
  const T* xp = x2.data_ptr<T>();
  const W* wp = reinterpret_cast<const W*>(w.data_ptr());
  const S* sp = s.defined() ? reinterpret_cast<const S*>(s.data_ptr()) : nullptr;
  T* yp = y.data_ptr<T>();
  if (m <= kGemvRows) {
    // Blocks of four rows (NOTE: [Four weight rows at a time]).
    const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(k * m, 1));
    at::parallel_for(0, (n + 3) / 4, grain, [&](int64_t b0, int64_t b1) {
      noteThread();
      gemvRows(xp, m, k, wp, sp, groups, yp, n, 4 * b0, std::min(n, 4 * b1));
    });
    return;
  }
  // Prefill: blocks of rows widened into a buffer, then BLAS.
  at::Tensor buffer = at::empty({kBlockRows, k}, x2.options());
  for (int64_t n0 = 0; n0 < n; n0 += kBlockRows) {
    const int64_t rows = std::min(kBlockRows, n - n0);
    T* bp = buffer.data_ptr<T>();
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      widenRows(wp, sp, groups, k, n0 + r0, r1 - r0, bp + r0 * k);
    });
    y.narrow(1, n0, rows).copy_(at::mm(x2, buffer.narrow(0, 0, rows).t()));
  }
}

// The CPU kernel of both ops (scales undefined for the narrow-float one).
at::Tensor kernel(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": NYI: weight-only linears on ", x.device(),
              " (a CPU kernel only). Run on the CPU, or keep the weights in the model's dtype on a GPU.");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, op, ": the input is ",
              x.scalar_type(), ", expected float32 or float64 (the weight is widened to the input's dtype).");
  TORCH_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == w.size(1), op, ": input ", x.sizes(), " and weight ",
              w.sizes(), " do not fit: expected x [..., k] and weight [n, k].");
  TORCH_CHECK(!(at::GradMode::is_enabled() && x.requires_grad()), op, ": NYI: backward through a weight-only "
              "linear (inference only). Run it under torch::NoGradGuard, or keep the weights in the model's dtype "
              "to train.");
  const int64_t k = w.size(1), n = w.size(0);
  int64_t groups = 0;
  if (scales.defined()) {
    TORCH_CHECK(w.scalar_type() == at::kChar &&
                    (scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat) && scales.size(0) == n &&
                    (scales.dim() == 1 || (scales.dim() == 2 && scales.size(1) > 0 && k % scales.size(1) == 0)),
                op, ": weight ", w.scalar_type(), w.sizes(), " with scales ", scales.scalar_type(), scales.sizes(),
                ": expected an int8 weight [n, k] with float16 or float32 scales [n] or [n, k / group_size].");
    groups = scales.dim() == 1 ? 1 : scales.size(1);
  } else {
    TORCH_CHECK(isNarrowFloat(w.scalar_type()), op, ": the weight is ", w.scalar_type(),
                ", expected bfloat16 or float16 (int8 weights go through int8_weight_only_linear).");
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const at::Tensor wc = w.contiguous(), sc = scales.defined() ? scales.contiguous() : scales;
  at::Tensor y = at::empty({x2.size(0), n}, x.options());
  if (x2.size(0) > 0 && n > 0) {
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "weight_only_linear", [&] {
      switch (w.scalar_type()) {
        case at::kChar:
          if (sc.scalar_type() == at::kHalf) linearLocal<scalar_t, int8_t, c10::Half>(x2, wc, sc, groups, y);
          else linearLocal<scalar_t, int8_t, float>(x2, wc, sc, groups, y);
          break;
        case at::kBFloat16: linearLocal<scalar_t, c10::BFloat16, float>(x2, wc, sc, groups, y); break;
        default: linearLocal<scalar_t, c10::Half, float>(x2, wc, sc, groups, y); break;
      }
    });
  }
  return y.view(shape);
}

at::Tensor narrowKernel(const at::Tensor& x, const at::Tensor& w) {
  return kernel(x, w, at::Tensor(), "dtp::weight_only_linear");
}
at::Tensor int8Kernel(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s) {
  return kernel(x, w, s, "dtp::int8_weight_only_linear");
}

// Per mesh dimension (x, weight[, scales] -> y):
std::vector<ShardingStrategy> weightOnlyRule(const ShardingCall& call) {
  const int64_t xd = call.input(0).ndim();
  const bool int8 = call.num_inputs() == 3;
  const bool grouped = int8 && call.input(2).ndim() == 2;
  auto in = [&](Placement x, Placement w, Placement s) {
    std::vector<Placement> v{x, w};
    if (int8) v.push_back(s);
    return v;
  };
  std::vector<ShardingStrategy> out = {
      {in(Replicate(), Replicate(), Replicate()), {Replicate()}},  // the whole product on every rank
      {in(Replicate(), Shard(0), Shard(0)), {Shard(xd - 1)}},      // colwise: each rank its output features
      // rowwise: each rank its inputs' share of every output, summed later
      {in(Shard(xd - 1), Shard(1), grouped ? Shard(1) : Replicate()), {Partial()}},
  };
  for (int64_t d = 0; d + 1 < xd; ++d)  // rows of x apart, the weight whole
    out.push_back({in(Shard(d), Replicate(), Replicate()), {Shard(d)}});
  return out;
}

OutputShapes outputShape(const ShardingCall& call) {
  std::vector<int64_t> shape = call.input(0).shape;
  shape.back() = call.input(1).shape[0];
  return {{shape}, {call.input(0).dtype}};
}

void ensureOps() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Plain objects, not TORCH_LIBRARY: static initializers vanish from
    // static libraries (STYLE.md).
    static auto* def = new torch::Library(torch::Library::DEF, "dtp", {}, __FILE__, __LINE__);
    def->def("weight_only_linear(Tensor x, Tensor weight) -> Tensor");
    def->def("int8_weight_only_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor");
    static auto* cpu = new torch::Library(torch::Library::IMPL, "dtp", c10::DispatchKey::CPU, __FILE__, __LINE__);
    cpu->impl("weight_only_linear", TORCH_FN(narrowKernel));
    cpu->impl("int8_weight_only_linear", TORCH_FN(int8Kernel));
    register_sharding("dtp::weight_only_linear", &weightOnlyRule, RegisterShardingOptions().shape(&outputShape));
    register_sharding("dtp::int8_weight_only_linear", &weightOnlyRule, RegisterShardingOptions().shape(&outputShape));
  });
}

// ---- Conversion. ----

// The mesh coordinates of every rank of `mesh`.
std::vector<std::vector<int64_t>> allCoordinates(const DeviceMesh& mesh) {
  std::vector<std::vector<int64_t>> out = {{}};
  for (int64_t d = 0; d < mesh.ndim(); ++d) {
    std::vector<std::vector<int64_t>> next;
    for (const auto& c : out) {
      for (int64_t i = 0; i < mesh.size(d); ++i) {
        next.push_back(c);
        next.back().push_back(i);
      }
    }
    out = std::move(next);
  }
  return out;
}

// max|w| / 127 (float64) as stored in `t`: float32 to nearest; float16
// rounded up (NOTE: [Float16 scales]). Returned in float64.
at::Tensor storedScale(const at::Tensor& s64, at::ScalarType t) {
  at::Tensor r = s64.to(t);
  if (t == at::kHalf) r = at::where(r.to(at::kDouble) < s64, (r.view(at::kShort) + 1).view(at::kHalf), r);
  return r.to(at::kDouble);
}

// Symmetric int8 of `w` [rows, k] (float): q and the scales [rows, groups]
// (groups = k / gs; their dtype is scales'), or the row maxima `amax` given
// (per row, under a rowwise weight: the whole row's). In row blocks, in
// float64, so that |w - q * scale| <= scale / 2 holds exactly for each
// element and its stored scale.
void quantizeRows(const at::Tensor& w, int64_t gs, const at::Tensor& row_amax, at::Tensor& q, at::Tensor& scales,
                  const std::string& fqn) {
  const int64_t rows = w.size(0), k = w.size(1);
  const int64_t groups = gs > 0 ? k / gs : 1;
  constexpr int64_t kChunk = 256;
  for (int64_t r0 = 0; r0 < rows; r0 += kChunk) {
    const int64_t nr = std::min(kChunk, rows - r0);
    const at::Tensor block = w.narrow(0, r0, nr).to(at::kDouble).view({nr, groups, k / groups});
    const at::Tensor amax = row_amax.defined() ? row_amax.narrow(0, r0, nr).to(at::kDouble).view({nr, 1, 1})
                                               : block.abs().amax({-1}, /*keepdim=*/true);
    const at::Tensor s64 = storedScale(amax / 127.0, scales.scalar_type());
    TORCH_CHECK(s64.isfinite().all().item<bool>(), "to_weight_only: '", fqn, "' has a weight of magnitude ",
                amax.max().item<double>(), " (or not finite), whose scale overflows ", scales.scalar_type(),
                ". Quantize it with WeightOnlyOptions().scale_dtype(at::kFloat), or keep it unquantized.");
    // A zero group (scale 0) quantizes to zeros.
    const at::Tensor qd = at::where(s64 > 0, at::round(block / s64.clamp_min(1e-300)), at::zeros_like(block));
    q.narrow(0, r0, nr).copy_(qd.clamp(-127, 127).view({nr, k}));
    scales.narrow(0, r0, nr).copy_(gs > 0 ? s64.view({nr, groups}) : s64.view({nr}));
  }
}

}  // namespace

namespace detail {
int weight_only_best_isa() { return detectIsa(); }
void set_weight_only_isa(int level) { forcedIsa.store(level, std::memory_order_relaxed); }
int weight_only_threads_seen() { return threadsSeen.exchange(0, std::memory_order_relaxed); }
}  // namespace detail

WeightOnlyOptions weight_only_options(const std::string& name, int64_t group_size) {
  WeightOnlyOptions o;
  o.group_size(group_size);
  if (name == "bfloat16" || name == "bf16") return o.dtype(at::kBFloat16);
  if (name == "float16" || name == "fp16") return o.dtype(at::kHalf);
  if (name == "int8") return o.dtype(at::kChar);
  TORCH_CHECK(false, "weight_only_options: unsupported weight format '", name, "': expected \"bfloat16\" (bf16), "
              "\"float16\" (fp16) or \"int8\" (weight-only quantization). NYI: int4 and other formats.");
}

void to_weight_only(HookedImpl<torch::nn::LinearImpl>& linear, const WeightOnlyOptions& options,
                    const std::string& fqn) {
  ensureOps();
  const c10::ScalarType dtype = options.dtype();
  const int64_t gs = options.group_size();
  TORCH_CHECK(dtype == at::kChar || isNarrowFloat(dtype), "to_weight_only: unsupported weight dtype ", dtype,
              " for '", fqn, "': expected bfloat16, float16 or int8 (at::kChar). NYI: other formats.");
  TORCH_CHECK(!linear.weight_only, "to_weight_only: '", fqn, "' is converted already (its weight is ",
              linear.weight.scalar_type(), "). Convert each Linear once.");
  const at::Tensor weight = linear.weight;
  TORCH_CHECK(weight.defined() && weight.dim() == 2 && at::isFloatingType(weight.scalar_type()), "to_weight_only: '",
              fqn, "' has weight ", weight.defined() ? weight.sizes() : c10::IntArrayRef{},
              ", expected a float matrix [out_features, in_features].");
  const bool dist = is_dtensor(weight);
  const at::Tensor local = dist ? to_local(weight.detach()) : weight.detach();
  TORCH_CHECK(!local.is_meta(), "to_weight_only: '", fqn, "' is on the meta device (deferred init): set its "
              "weight first (init_weights or a load), then convert.");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(gs >= 0, "to_weight_only: group_size=", gs, " for '", fqn, "': expected 0 (one scale per row) or a "
              "positive group width.");
  const c10::ScalarType sdtype = options.scale_dtype();
  TORCH_CHECK(sdtype == at::kHalf || sdtype == at::kFloat, "to_weight_only: scale_dtype ", sdtype, " for '", fqn,
              "': expected float16 (Q8_0's) or float32.");
  at::NoGradGuard no_grad;
  auto wrap = [&](const at::Tensor& t, const Placements& p, std::vector<int64_t> shape) {
    return dist ? from_local(t, device_mesh(weight), p, /*run_check=*/false, shape) : t;
  };
  linear.weight.requires_grad_(false);  // the replacement keeps it: int8 cannot require grad
  if (dtype != at::kChar) {
    at::Tensor narrow = wrap(local.to(dtype), dist ? placements(weight) : Placements{}, {n, k});
    set_parameter(linear, "weight", narrow);
    linear.weight_only = true;
    return;
  }
  // int8: where the scales live follows the weight's placements.
  Placements scalePlacements;
  std::vector<int64_t> rowwiseDims;  // mesh dims splitting each row
  if (dist) {
    const DTensorSpec& spec = dtensor_spec(weight);
    for (size_t d = 0; d < spec.placements.size(); ++d) {
      const Placement& p = spec.placements[d];
      TORCH_CHECK(!p.is_partial(), "to_weight_only: '", fqn, "' has a Partial weight (", spec.str(),
                  "), expected Shard or Replicate placements.");
      if (p.is_shard() && p.dim == 1) rowwiseDims.push_back(static_cast<int64_t>(d));
      scalePlacements.push_back(p.is_shard() && p.dim == 1 && gs == 0 ? Replicate() : p);
    }
    if (gs > 0 && !rowwiseDims.empty()) {
      for (const auto& coord : allCoordinates(spec.mesh)) {
        const auto sizes = spec.local_shape(coord), offsets = spec.local_offset(coord);
        TORCH_CHECK(sizes[1] % gs == 0 && offsets[1] % gs == 0, "to_weight_only: group_size ", gs,
                    " does not divide the shard of '", fqn, "' (", spec.str(), "): the rank at mesh coordinate ",
                    c10::IntArrayRef(coord), " holds inputs [", offsets[1], ", ", offsets[1] + sizes[1],
                    "), expected each rank's inputs to start and end on a group boundary. Pick a group_size "
                    "dividing in_features / tp, or group_size 0 (one scale per row).");
      }
    }
  }
  TORCH_CHECK(gs == 0 || k % gs == 0, "to_weight_only: group_size ", gs, " does not divide in_features=", k,
              " of '", fqn, "'. Pick a group_size dividing it, or 0 (one scale per row).");
  at::Tensor rowAmax;
  if (gs == 0 && !rowwiseDims.empty()) {
    // Each rank holds a piece of every row: the row's maximum over the pieces.
    rowAmax = local.numel() > 0 ? local.abs().amax({1}).to(at::kFloat) : at::zeros({local.size(0)}, at::kFloat);
    for (int64_t d : rowwiseDims) device_mesh(weight).get_group(d).all_reduce(rowAmax, ReduceOp::Max).wait();
  }
  at::Tensor q = at::empty(local.sizes(), local.options().dtype(at::kChar));
  at::Tensor s = gs > 0 ? at::empty({local.size(0), local.size(1) / gs}, local.options().dtype(sdtype))
                        : at::empty({local.size(0)}, local.options().dtype(sdtype));
  if (local.numel() > 0) quantizeRows(local, gs, rowAmax, q, s, fqn);
  else s.zero_();
  std::vector<int64_t> sShape = gs > 0 ? std::vector<int64_t>{n, k / gs} : std::vector<int64_t>{n};
  at::Tensor qw = wrap(q, dist ? placements(weight) : Placements{}, {n, k});
  at::Tensor sw = wrap(s, scalePlacements, sShape);
  set_parameter(linear, "weight", qw);
  linear.weight_scales = linear.register_buffer("weight_scales", sw);
  linear.weight_only = true;
}

at::Tensor weight_only_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                              const at::Tensor& bias) {
  ensureOps();
  at::Tensor y;
  if (scales.defined()) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("dtp::int8_weight_only_linear", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    y = op.call(x, weight, scales);
  } else {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("dtp::weight_only_linear", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
    y = op.call(x, weight);
  }
  return bias.defined() ? y + bias : y;
}

at::Tensor dequantized_weight(const HookedImpl<torch::nn::LinearImpl>& linear, c10::ScalarType dtype) {
  const at::Tensor& w = linear.weight;
  if (!linear.weight_scales.defined()) return w.to(dtype);
  const at::Tensor& s = linear.weight_scales;
  const at::Tensor wl = is_dtensor(w) ? to_local(w) : w, sl = is_dtensor(s) ? to_local(s) : s;
  at::Tensor out;
  if (sl.dim() == 1) {
    out = wl.to(dtype) * sl.to(dtype).unsqueeze(1);
  } else {
    const int64_t groups = sl.size(1);
    out = sl.numel() == 0 ? wl.to(dtype)
                          : (wl.to(dtype).view({wl.size(0), groups, -1}) * sl.to(dtype).unsqueeze(2)).view(wl.sizes());
  }
  return is_dtensor(w) ? from_local(out, device_mesh(w), placements(w), /*run_check=*/false, w.sizes().vec()) : out;
}

}  // namespace dtp::nn
