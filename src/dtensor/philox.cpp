// Philox4x32-10 draws over a box of a tensor, as a CPU loop and as ATen
// tensor ops that give the same bits. See NOTE: [Per-shard random numbers].
// Compiled with -ffp-contract=off (CMakeLists.txt): a fused multiply-add
// would round once where the tensor ops round twice.
#include "dtensor/philox.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace dtp::detail {
namespace {

// Random123's Philox4x32 multipliers and Weyl key increments.
constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
constexpr int kRounds = 10;

constexpr double kTwoM24 = 1.0 / 16777216.0;          // 2^-24
constexpr double kTwoM53 = 1.0 / 9007199254740992.0;  // 2^-53
constexpr double kTwo26 = 67108864.0;                 // 2^26
constexpr double kSqrtHalf = 0.70710678118654752440;
constexpr double kLn2 = 0.69314718055994530942;
constexpr double kTwoPi = 6.28318530717958647693;

// Series coefficients, the same doubles for both paths:
// ln m = 2 s sum_k s^2k / (2k+1), s = (m-1)/(m+1), |s| <= 0.172 (m in [sqrt(1/2), sqrt(2))): 12 terms;
// cos x = sum_k (-1)^k x^2k / (2k)!, sin x = x sum_k (-1)^k x^2k / (2k+1)!, |x| <= pi: 15 terms
// (the first left out is below 3e-18).
constexpr int kLogTerms = 12, kTrigTerms = 15;
struct Coefficients {
  double log[kLogTerms], cos[kTrigTerms], sin[kTrigTerms];
  Coefficients() {
    for (int k = 0; k < kLogTerms; ++k) log[k] = 1.0 / (2 * k + 1);
    double c = 1.0, s = 1.0;  // (-1)^k / (2k)!, (-1)^k / (2k+1)!
    for (int k = 0; k < kTrigTerms; ++k) {
      cos[k] = c;
      sin[k] = s;
      c = -c / ((2 * k + 1) * (2 * k + 2));
      s = -s / ((2 * k + 2) * (2 * k + 3));
    }
  }
};
const Coefficients& coefficients() {
  static const Coefficients c;
  return c;
}

// ---- The scalar path (CPU loop) ----

inline double u24(uint32_t w) { return static_cast<double>(w >> 8) * kTwoM24; }
inline uint64_t bits53(uint32_t a, uint32_t b) { return (static_cast<uint64_t>(a >> 5) << 26) | (b >> 6); }
inline double u53(uint32_t a, uint32_t b) { return static_cast<double>(bits53(a, b)) * kTwoM53; }

double seriesLog(double u) {  // u in (0, 1]
  const Coefficients& k = coefficients();
  int e = 0;
  double m = std::frexp(u, &e);
  if (m < kSqrtHalf) {
    m = m * 2.0;
    e -= 1;
  }
  const double s = (m - 1.0) / (m + 1.0);
  const double s2 = s * s;
  double p = k.log[kLogTerms - 1];
  for (int i = kLogTerms - 2; i >= 0; --i) p = p * s2 + k.log[i];
  const double t = s * p;
  return static_cast<double>(e) * kLn2 + t * 2.0;
}

// The normal pair of one block: (r cos 2 pi u2, r sin 2 pi u2).
std::array<double, 2> boxMuller(const std::array<uint32_t, 4>& w) {
  const Coefficients& k = coefficients();
  const double u1 = static_cast<double>(bits53(w[0], w[1]) + 1) * kTwoM53;
  const double u2 = u53(w[2], w[3]);
  const double r = std::sqrt(seriesLog(u1) * -2.0);
  const double x = (u2 - 0.5) * kTwoPi;  // 2 pi u2 - pi: cos and sin change sign
  const double x2 = x * x;
  double pc = k.cos[kTrigTerms - 1], ps = k.sin[kTrigTerms - 1];
  for (int i = kTrigTerms - 2; i >= 0; --i) {
    pc = pc * x2 + k.cos[i];
    ps = ps * x2 + k.sin[i];
  }
  const double c = -pc, s = -(x * ps);
  return {r * c, r * s};
}

template <typename T>
inline T roundTo(double v) {
  if constexpr (std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>)
    return T(static_cast<float>(v));
  else
    return static_cast<T>(v);
}

std::vector<int64_t> rowMajorStrides(c10::IntArrayRef shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d) s[d] = s[d + 1] * shape[d + 1];
  return s;
}

// Stores value(block(words), i % E, q) at each local position q of the box
// (i: the element's global index), computing each Philox block once per run.
template <int64_t E, typename T, typename Block, typename Value>
void cpuLoop(at::Tensor& out, c10::IntArrayRef shape, c10::IntArrayRef box_offset, uint64_t seed, uint64_t offset,
             const Block& block, const Value& value) {
  const auto gs = rowMajorStrides(shape);
  const auto sizes = out.sizes().vec();
  const int64_t n = static_cast<int64_t>(sizes.size());
  const int64_t last = n == 0 ? 1 : sizes[n - 1];
  const std::array<uint32_t, 2> key{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  const uint32_t off_lo = static_cast<uint32_t>(offset), off_hi = static_cast<uint32_t>(offset >> 32);
  T* data = out.data_ptr<T>();
  at::parallel_for(0, out.numel(), 1 << 14, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1;) {
      const int64_t row = q / last;
      const int64_t end = std::min(q1, (row + 1) * last);
      int64_t base = n == 0 ? 0 : box_offset[n - 1];
      for (int64_t d = n - 2, rem = row; d >= 0; --d) {
        base += (box_offset[d] + rem % sizes[d]) * gs[d];
        rem /= sizes[d];
      }
      base -= row * last;  // global index of local position q in this row: base + q
      while (q < end) {  // one Philox block per pass
        const uint64_t i = static_cast<uint64_t>(base + q);
        const uint64_t b = i / E;
        const auto w = block(philox4x32_10({static_cast<uint32_t>(b), static_cast<uint32_t>(b >> 32), off_lo, off_hi}, key));
        const int first = static_cast<int>(i % E);
        if (first == 0 && q + E <= end) {  // a whole block: a fixed trip count the compiler unrolls
          for (int sub = 0; sub < E; ++sub) data[q + sub] = roundTo<T>(value(w, sub, q + sub));
          q += E;
          continue;
        }
        for (int sub = first; sub < E && q < end; ++sub, ++q) data[q] = roundTo<T>(value(w, sub, q));
      }
    }
  });
}

void fillCpu(at::Tensor& out, const PhiloxDraw& draw, c10::IntArrayRef shape, c10::IntArrayRef box_offset,
             uint64_t seed, uint64_t offset) {
  const double a = draw.a, b = draw.b;
  const auto words = [](const std::array<uint32_t, 4>& w) { return w; };
  switch (draw.kind) {
    case DrawKind::Uniform: {
      const double range = b - a;
      if (out.scalar_type() == at::kDouble) {
        cpuLoop<2, double>(out, shape, box_offset, seed, offset, words, [&](const auto& w, int sub, int64_t) {
          return u53(w[2 * sub], w[2 * sub + 1]) * range + a;
        });
        return;
      }
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "philox_uniform", [&] {
        cpuLoop<4, scalar_t>(out, shape, box_offset, seed, offset, words,
                             [&](const auto& w, int sub, int64_t) { return u24(w[sub]) * range + a; });
      });
      return;
    }
    case DrawKind::Normal:
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "philox_normal", [&] {
        cpuLoop<2, scalar_t>(out, shape, box_offset, seed, offset, [](const std::array<uint32_t, 4>& w) { return boxMuller(w); },
                             [&](const auto& z, int sub, int64_t) { return z[sub] * b + a; });
      });
      return;
    case DrawKind::Bernoulli: {
      at::Tensor probs = draw.probs.defined() ? draw.probs.to(at::kDouble).contiguous() : at::Tensor();
      const double* p = probs.defined() ? probs.data_ptr<double>() : nullptr;
      AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, out.scalar_type(), "philox_bernoulli", [&] {
        cpuLoop<4, scalar_t>(out, shape, box_offset, seed, offset, words, [&](const auto& w, int sub, int64_t q) {
          return static_cast<double>(static_cast<int>(u24(w[sub]) < (p ? p[q] : a)));  // no branch on the draw
        });
      });
      return;
    }
  }
}

// ---- The tensor path: the same arithmetic as ATen ops on int64 words ----

using Words = std::array<at::Tensor, 4>;

// (lo, hi) 32-bit halves of m * x for 32-bit m and int64 tensor x in [0, 2^32),
// from 16-bit halves so that no product passes 2^33.
std::pair<at::Tensor, at::Tensor> mulhilo(uint32_t m, const at::Tensor& x) {
  const int64_t mh = m >> 16, ml = m & 0xFFFF;
  const at::Tensor xh = x.__rshift__(16), xl = x.bitwise_and(0xFFFF);
  const at::Tensor p0 = xl.mul(ml);
  const at::Tensor mid = xl.mul(mh).add(xh.mul(ml)).add(p0.__rshift__(16));
  at::Tensor lo = mid.bitwise_and(0xFFFF).__lshift__(16).bitwise_or(p0.bitwise_and(0xFFFF));
  at::Tensor hi = xh.mul(mh).add(mid.__rshift__(16));
  return {lo, hi};
}

Words philoxTensor(const at::Tensor& block, uint64_t seed, uint64_t offset) {
  Words c{block.bitwise_and(int64_t{0xFFFFFFFF}), block.__rshift__(32),
          at::full_like(block, static_cast<int64_t>(offset & 0xFFFFFFFFu)),
          at::full_like(block, static_cast<int64_t>(offset >> 32))};
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int r = 0; r < kRounds; ++r) {
    if (r > 0) {
      k0 += kW0;
      k1 += kW1;
    }
    auto [lo0, hi0] = mulhilo(kM0, c[0]);
    auto [lo1, hi1] = mulhilo(kM1, c[2]);
    c = {hi1.bitwise_xor(c[1]).bitwise_xor(static_cast<int64_t>(k0)), lo1,
         hi0.bitwise_xor(c[3]).bitwise_xor(static_cast<int64_t>(k1)), lo0};
  }
  return c;
}

at::Tensor u24T(const at::Tensor& w) { return w.__rshift__(8).to(at::kDouble).mul(kTwoM24); }
at::Tensor bits53T(const at::Tensor& a, const at::Tensor& b) { return a.__rshift__(5).__lshift__(26).bitwise_or(b.__rshift__(6)); }

at::Tensor seriesLogT(const at::Tensor& u) {
  const Coefficients& k = coefficients();
  auto [mant, ex] = at::frexp(u);
  const at::Tensor small = mant.lt(kSqrtHalf);
  const at::Tensor m = at::where(small, mant.mul(2.0), mant);
  const at::Tensor e = ex.to(at::kDouble).sub(small.to(at::kDouble));
  const at::Tensor s = m.sub(1.0).div(m.add(1.0));
  const at::Tensor s2 = s.mul(s);
  at::Tensor p = at::full_like(s, k.log[kLogTerms - 1]);
  for (int i = kLogTerms - 2; i >= 0; --i) p = p.mul(s2).add(k.log[i]);
  return e.mul(kLn2).add(s.mul(p).mul(2.0));
}

std::array<at::Tensor, 2> boxMullerT(const Words& w) {
  const Coefficients& k = coefficients();
  const at::Tensor u1 = bits53T(w[0], w[1]).add(1).to(at::kDouble).mul(kTwoM53);
  const at::Tensor u2 = bits53T(w[2], w[3]).to(at::kDouble).mul(kTwoM53);
  const at::Tensor r = seriesLogT(u1).mul(-2.0).sqrt();
  const at::Tensor x = u2.sub(0.5).mul(kTwoPi);
  const at::Tensor x2 = x.mul(x);
  at::Tensor pc = at::full_like(x, k.cos[kTrigTerms - 1]), ps = at::full_like(x, k.sin[kTrigTerms - 1]);
  for (int i = kTrigTerms - 2; i >= 0; --i) {
    pc = pc.mul(x2).add(k.cos[i]);
    ps = ps.mul(x2).add(k.sin[i]);
  }
  return {r.mul(pc.neg()), r.mul(x.mul(ps).neg())};
}

// The values (float64, or bool for Bernoulli) of global elements `idx`
// (local positions q for per-element probabilities).
at::Tensor valuesT(const PhiloxDraw& draw, c10::ScalarType dtype, const at::Tensor& idx, const at::Tensor& probs_chunk,
                   uint64_t seed, uint64_t offset) {
  const int64_t e = philox_elements_per_block(draw.kind, dtype);
  const at::Tensor sub = idx.remainder(e);
  const Words w = philoxTensor(idx.div(e, "floor"), seed, offset);
  auto pick4 = [&] { return at::stack({w[0], w[1], w[2], w[3]}, 1).gather(1, sub.unsqueeze(1)).squeeze(1); };
  switch (draw.kind) {
    case DrawKind::Uniform: {
      const double range = draw.b - draw.a;
      at::Tensor u;
      if (e == 2) {
        const at::Tensor first = sub.eq(0);
        u = bits53T(at::where(first, w[0], w[2]), at::where(first, w[1], w[3])).to(at::kDouble).mul(kTwoM53);
      } else {
        u = u24T(pick4());
      }
      return u.mul(range).add(draw.a);
    }
    case DrawKind::Normal: {
      const auto z = boxMullerT(w);
      return at::where(sub.eq(0), z[0], z[1]).mul(draw.b).add(draw.a);
    }
    case DrawKind::Bernoulli: {
      const at::Tensor u = u24T(pick4());
      return probs_chunk.defined() ? u.lt(probs_chunk) : u.lt(draw.a);
    }
  }
  TORCH_INTERNAL_ASSERT(false);
  return {};
}

void fillTensorOps(at::Tensor& out, const PhiloxDraw& draw, c10::IntArrayRef shape, c10::IntArrayRef box_offset,
                   uint64_t seed, uint64_t offset) {
  const auto gs = rowMajorStrides(shape);
  const auto sizes = out.sizes().vec();
  const int64_t n = static_cast<int64_t>(sizes.size());
  const auto i64 = at::TensorOptions().dtype(at::kLong).device(out.device());
  at::Tensor flat = out.view({-1});
  const at::Tensor probs = draw.probs.defined() ? draw.probs.to(at::kDouble).reshape({-1}) : at::Tensor();
  constexpr int64_t kChunk = int64_t{1} << 20;  // bounds the int64 temporaries
  for (int64_t start = 0; start < flat.numel(); start += kChunk) {
    const int64_t len = std::min(kChunk, flat.numel() - start);
    at::Tensor rem = at::arange(start, start + len, i64);
    at::Tensor idx = at::zeros({len}, i64);
    for (int64_t d = n - 1; d >= 0; --d) {
      idx.add_(rem.remainder(sizes[d]).add(box_offset[d]).mul(gs[d]));
      rem = rem.div(sizes[d], "floor");
    }
    at::Tensor v = valuesT(draw, out.scalar_type(), idx, probs.defined() ? probs.narrow(0, start, len) : probs,
                           seed, offset);
    if (out.scalar_type() == at::kHalf || out.scalar_type() == at::kBFloat16) v = v.to(at::kFloat);
    flat.narrow(0, start, len).copy_(v);
  }
}

}  // namespace

std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  for (int r = 0; r < kRounds; ++r) {
    if (r > 0) {
      k[0] += kW0;
      k[1] += kW1;
    }
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c[0], p1 = static_cast<uint64_t>(kM1) * c[2];
    c = {static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k[0], static_cast<uint32_t>(p1),
         static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k[1], static_cast<uint32_t>(p0)};
  }
  return c;
}

int64_t philox_elements_per_block(DrawKind kind, c10::ScalarType dtype) {
  switch (kind) {
    case DrawKind::Uniform: return dtype == at::kDouble ? 2 : 4;
    case DrawKind::Normal: return 2;
    case DrawKind::Bernoulli: return 4;
  }
  return 4;
}

uint64_t philox_blocks(DrawKind kind, c10::ScalarType dtype, int64_t numel) {
  const int64_t e = philox_elements_per_block(kind, dtype);
  return static_cast<uint64_t>((numel + e - 1) / e);
}

void philox_fill(at::Tensor& out, const PhiloxDraw& draw, c10::IntArrayRef shape, c10::IntArrayRef box_offset,
                 uint64_t seed, uint64_t offset, bool tensor_ops) {
  TORCH_INTERNAL_ASSERT(out.is_contiguous() && out.dim() == static_cast<int64_t>(shape.size()) &&
                        box_offset.size() == shape.size());
  TORCH_INTERNAL_ASSERT(!draw.probs.defined() || draw.probs.sizes() == out.sizes());
  if (out.numel() == 0) return;
  if (out.device().is_cpu() && !tensor_ops) fillCpu(out, draw, shape, box_offset, seed, offset);
  else fillTensorOps(out, draw, shape, box_offset, seed, offset);
}

}  // namespace dtp::detail
