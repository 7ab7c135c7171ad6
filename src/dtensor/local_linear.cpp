// NOTE: [One-row linear]
// A linear of one row on the CPU (decode at batch 1: x [1, 1, k] times the
// weight [n, k]) is a matrix-vector product, but at::linear makes it
// aten::mm of [1, k] by weight.t(), which libtorch hands to the BLAS's
// GEMM. OpenBLAS 0.3.21's sgemm packs (copies) the weight before
// multiplying, even for one row: at Llama-3.2-1B's shape a float32 decode
// step spent 94% of its time in that mm at 4.9 GB/s, where at::mv on the
// same contiguous weight (a GEMV, which streams each row once) reads 20-22
// GB/s (docs/benchmarks.md, "Where a decode step's time goes"). So where
// dtp computes a linear on tensors it holds (nn::Linear's forward, the
// local op of DTensor's linear and matmul: linear_local, fusedProduct), a
// product that meets all of these runs as at::mv / at::addmv:
//  - x and the weight plain (not DTensors), strided, on the CPU, float32 or
//    float64, of one dtype (bfloat16 goes to oneDNN's GEMM, which reads 3x
//    faster than at::mv there: not taken);
//  - x's leading dims multiply to 1 (x 1-D is at::linear's own mv already);
//  - the weight 2-D [n, k], rows dense (stride 1 along k, as a contiguous
//    weight or a column shard of one), n, k > 0;
//  - the bias undefined, or [n] of x's dtype on the CPU;
//  - no autograd graph is recorded (grad mode off, or nothing requires
//    grad). Training keeps at::linear: mv's backward computes x's gradient
//    as a GEMV of weight.t() in another summation order than mm's, so
//    TP=N training would no longer match its one-device reference bit for
//    bit where it does now, and one-row training is not a hot path.
// Not an override of aten::mm: a user's own at::linear is untouched.
// The value differs from at::linear's only by the summation order: both
// are within gamma_(k+1) * (|W| |x| + |b|) of the exact product
// (tests/one_row_linear_test.cpp asserts twice that between them).
//   The GEMV itself is dtp::detail::gemv (gemv.h: Eigen's, built for AVX2
// and FMA, where the CPU has them and Eigen was found at build time, on
// libtorch's OpenMP threads or, in a build without them, on one thread;
// NOTE: [Eigen GEMV]), else at::mv / at::addmv.
#include "dtensor/local_linear.h"

#include "dtensor/dtensor_impl.h"
#include "dtensor/gemv.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>

namespace dtp::detail {

namespace {

bool plainCpuFloat(const at::Tensor& t) {
  return t.defined() && !isDTensor(t) && t.layout() == at::kStrided && t.device().is_cpu() &&
         (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble);
}

bool requiresGrad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }

// x [..., k] times a weight w [n, k] with dense rows, as one row: [..., n].
at::Tensor oneRow(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  const at::Tensor v = x.reshape({x.size(-1)});
  at::Tensor y = gemv(w, v, bias);
  if (!y.defined()) y = bias.defined() ? at::addmv(bias, w, v) : at::mv(w, v);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = w.size(0);
  return y.view(shape);
}

}  // namespace

bool takes_one_row_path(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (!plainCpuFloat(x) || !plainCpuFloat(weight) || x.scalar_type() != weight.scalar_type()) return false;
  if (x.dim() < 2 || weight.dim() != 2) return false;
  const int64_t n = weight.size(0), k = weight.size(1);
  if (n == 0 || k == 0 || x.size(-1) != k || x.numel() != k) return false;
  if (weight.stride(1) != 1 || weight.stride(0) < k) return false;
  if (bias.defined() && (!plainCpuFloat(bias) || bias.scalar_type() != x.scalar_type() || bias.dim() != 1 ||
                         bias.size(0) != n))
    return false;
  return !(at::GradMode::is_enabled() && (requiresGrad(x) || requiresGrad(weight) || requiresGrad(bias)));
}

at::Tensor local_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (takes_one_row_path(x, weight, bias)) return oneRow(x, weight, bias);
  return at::linear(x, weight, bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt);
}

at::Tensor local_matmul(const at::Tensor& x, const at::Tensor& m) {
  if (m.dim() == 2 && x.dim() >= 2 && takes_one_row_path(x, m.t(), at::Tensor())) return oneRow(x, m.t(), at::Tensor());
  return at::matmul(x, m);
}

namespace {

// NOTE: [Empty shards run no kernel] (sharding_prop.cpp) holds for ops
// without a LocalFn only; these two keep it themselves.
bool emptyOutput(const Decision& d) {
  if (d.out.empty() || d.out[0] == nullptr) return false;
  const auto& s = d.out[0]->local_sizes;
  return std::find(s.begin(), s.end(), 0) != s.end();
}

at::Tensor emptyOutputOf(const Decision& d, const at::Tensor& x) {
  return at::empty(d.out[0]->local_sizes, at::TensorOptions(d.out[0]->dtype).device(x.device()));
}

}  // namespace

void linear_local(const c10::OperatorHandle&, torch::jit::Stack* stack, const Decision& d) {
  const auto bias = torch::jit::pop(*stack).toOptional<at::Tensor>();
  const at::Tensor weight = torch::jit::pop(*stack).toTensor(), x = torch::jit::pop(*stack).toTensor();
  if (emptyOutput(d)) {
    torch::jit::push(*stack, emptyOutputOf(d, x));
    return;
  }
  torch::jit::push(*stack, local_linear(x, weight, bias.value_or(at::Tensor())));
}

void matmul_local(const c10::OperatorHandle&, torch::jit::Stack* stack, const Decision& d) {
  const at::Tensor m = torch::jit::pop(*stack).toTensor(), x = torch::jit::pop(*stack).toTensor();
  if (emptyOutput(d)) {
    torch::jit::push(*stack, emptyOutputOf(d, x));
    return;
  }
  torch::jit::push(*stack, local_matmul(x, m));
}

}  // namespace dtp::detail
