// Tensor comparisons that say where they differ:
//
//   EXPECT_CLOSE(full_tensor(y), ref, /*rtol=*/1e-5, /*atol=*/1e-5) << "output";
//
// passes exactly when a.allclose(b, rtol, atol) does (torch's rule, element
// by element: |a - b| <= atol + rtol * |b|, NaN never close, b broadcast to
// a's shape), so a site written with allclose keeps its tolerance by passing
// the same two numbers; a bound on the largest absolute error alone is
// rtol = 0. A failure points at the caller's line and prints both
// expressions, both shapes, how many elements miss their bound and the one
// that misses it by most: its index, both values, its absolute and relative
// error and its bound.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <iomanip>
#include <limits>
#include <sstream>
#include <vector>

namespace dtp::test {

// The predicate-formatter behind EXPECT_CLOSE / ASSERT_CLOSE.
inline ::testing::AssertionResult close_format(const char* a_expr, const char* b_expr, const char* rtol_expr,
                                               const char* atol_expr, const at::Tensor& a, const at::Tensor& b,
                                               double rtol, double atol) {
  std::ostringstream head;
  head << a_expr << " is not close to " << b_expr << " (|a - b| <= atol + rtol * |b|, rtol " << rtol_expr
       << " = " << rtol << ", atol " << atol_expr << " = " << atol << ")\n  shapes: " << a.scalar_type()
       << a.sizes() << " vs " << b.scalar_type() << b.sizes();
  bool close = false;
  try {
    close = a.allclose(b, rtol, atol);
  } catch (const c10::Error& e) {
    return ::testing::AssertionFailure() << head.str() << "; allclose refused them: " << e.what_without_backtrace();
  }
  if (close) return ::testing::AssertionSuccess();

  // Diagnostics in float64 on the host, after broadcasting as allclose does.
  const std::vector<at::Tensor> ab =
      at::broadcast_tensors({a.detach().to(at::kCPU).to(at::kDouble), b.detach().to(at::kCPU).to(at::kDouble)});
  const at::Tensor x = ab[0].contiguous(), y = ab[1].contiguous();
  const at::Tensor err = (x - y).abs(), bound = atol + rtol * y.abs();
  const double inf = std::numeric_limits<double>::infinity();
  // How far each element is past its bound; NaN (never close) first, equal
  // values (infinities included: allclose calls them close) last.
  at::Tensor excess = at::where(at::isnan(err), at::full_like(err, inf), err - bound);
  excess = at::where(x == y, at::full_like(err, -inf), excess);
  const int64_t worst = excess.reshape(-1).argmax().item<int64_t>();
  const int64_t missed = (excess > 0).sum().item<int64_t>();

  std::vector<int64_t> index(x.dim());
  for (int64_t d = x.dim() - 1, rest = worst; d >= 0; --d) {
    index[d] = rest % x.size(d);
    rest /= x.size(d);
  }
  const double av = x.reshape(-1)[worst].item<double>(), bv = y.reshape(-1)[worst].item<double>();
  const double abs_err = err.reshape(-1)[worst].item<double>();
  std::ostringstream out;
  out << head.str() << "; " << missed << " of " << x.numel() << " elements miss their bound\n  worst at "
      << c10::IntArrayRef(index) << ": " << std::setprecision(17) << av << " vs " << bv << std::setprecision(3)
      << " (abs error " << abs_err << ", rel error " << (bv == 0 ? inf : abs_err / std::abs(bv)) << ", bound "
      << bound.reshape(-1)[worst].item<double>() << ")";
  return ::testing::AssertionFailure() << out.str();
}

}  // namespace dtp::test

// EXPECT_CLOSE(a, b, rtol, atol): a.allclose(b, rtol, atol), with a message
// that shows the worst element. Streams more context with <<, as EXPECT_*.
#define EXPECT_CLOSE(a, b, rtol, atol) EXPECT_PRED_FORMAT4(::dtp::test::close_format, a, b, rtol, atol)
#define ASSERT_CLOSE(a, b, rtol, atol) ASSERT_PRED_FORMAT4(::dtp::test::close_format, a, b, rtol, atol)
