// Pointwise ops: one table per linearity class, expanded over broadcasting.
#include "dtensor/rules/common.h"

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>

namespace dtp {
namespace rules {

std::vector<Row> pointwise_rows(const OpCall& call, int64_t m, Linearity lin) {
  std::vector<Row> rows{replicate_row(call)};
  const auto& out = call.out_shapes[0];
  const int64_t ond = static_cast<int64_t>(out.size());
  const size_t n = call.specs.size();
  for (int64_t od = 0; od < ond; ++od) {
    Row r{Placements(n), Placements(call.num_outputs, Shard(od))};
    for (size_t s = 0; s < n; ++s) {
      const auto& shape = call.spec(s).shape;
      const int64_t id = od - (ond - static_cast<int64_t>(shape.size()));
      r.in[s] = (id >= 0 && shape[id] == out[od]) ? Shard(id) : Replicate();
    }
    rows.push_back(std::move(r));
  }
  const Placement p = linear_partial(call, m);
  switch (lin) {
    case Linearity::None:
      break;
    case Linearity::Linear:  // (a0+a1)+(b0+b1) = (a0+b0)+(a1+b1)
      rows.push_back(Row{Placements(n, p), Placements(call.num_outputs, p)});
      break;
    case Linearity::Multilinear:  // (a0+a1)*b = a0*b + a1*b
      for (size_t s = 0; s < n; ++s) {
        Row r{Placements(n, Replicate()), Placements(call.num_outputs, p)};
        r.in[s] = p;
        rows.push_back(std::move(r));
      }
      break;
    case Linearity::FirstArg: {  // (a0+a1)/b = a0/b + a1/b
      Row r{Placements(n, Replicate()), Placements(call.num_outputs, p)};
      r.in[0] = p;
      rows.push_back(std::move(r));
      break;
    }
  }
  return rows;
}

std::vector<c10::ScalarType> dtypesFromStandIns(const OpCall& call) {
  torch::jit::Stack stack;
  auto standIn = [](const at::Tensor& t) -> at::Tensor {
    if (auto* impl = maybeGetDTensorImpl(t)) {
      return at::ones(std::vector<int64_t>(impl->spec().ndim(), 1),
                      at::TensorOptions().dtype(impl->spec().dtype).device(impl->local().device()));
    }
    return t;
  };
  for (const auto& v : call.args) {
    if (v.isTensor()) stack.emplace_back(standIn(v.toTensor()));
    else stack.push_back(v);
  }
  call.op.callBoxed(&stack);
  std::vector<c10::ScalarType> dtypes;
  for (const auto& v : stack)
    if (v.isTensor()) dtypes.push_back(v.toTensor().scalar_type());
  return dtypes;
}

}  // namespace rules

namespace {

// Broadcast shape of all tensor inputs (for ops without meta kernels in 1.13).
OutputMeta pointwiseShape(const OpCall& call) {
  std::vector<int64_t> shape;
  for (const auto* s : call.specs) shape = at::infer_size(shape, s->shape);
  OutputMeta m;
  m.dtypes = rules::dtypesFromStandIns(call);
  m.shapes.assign(m.dtypes.size(), shape);
  return m;
}

void addAll(RuleRegistry& r, std::initializer_list<const char*> ops, rules::Linearity lin) {
  for (const char* op : ops) {
    r.add(op, [lin](const OpCall& call, int64_t m) { return rules::pointwise_rows(call, m, lin); },
          pointwiseShape);
  }
}

// masked_fill(self, mask, 0) is linear in self, which a Partial may then
// keep: (a0+a1) masked to 0 = a0 masked to 0 + a1 masked to 0 (libtorch
// 2.x's cross_entropy zeroes label smoothing's ignored rows this way). Any
// other value is not. The propagation cache tells zero scalars apart.
std::vector<Row> maskedFillRows(const OpCall& call, int64_t m) {
  const c10::IValue& value = call.args[2];
  const bool zero = value.isScalar() && value.toScalar().equal(0);
  return rules::pointwise_rows(call, m, zero ? rules::Linearity::FirstArg : rules::Linearity::None);
}

// addcmul(self, t1, t2, value) = self + value·t1·t2 is affine, not
// multilinear: a Partial self alone would add t1·t2 once per rank. It is
// linear in (self, t1) with t2 fixed, and in (self, t2) with t1 fixed:
// (s0 + v·a0·t2) + (s1 + v·a1·t2) = s + v·(a0+a1)·t2.
std::vector<Row> addcmulRows(const OpCall& call, int64_t m) {
  auto rows = rules::pointwise_rows(call, m, rules::Linearity::None);
  if (call.specs.size() == 3) {
    const Placement p = rules::linear_partial(call, m);
    rows.push_back(Row{{p, p, Replicate()}, {p}});
    rows.push_back(Row{{p, Replicate(), p}, {p}});
  }
  return rows;
}

// addcdiv(self, t1, t2, value) = self + value·t1/t2: linear in (self, t1).
std::vector<Row> addcdivRows(const OpCall& call, int64_t m) {
  auto rows = rules::pointwise_rows(call, m, rules::Linearity::None);
  if (call.specs.size() == 3) {
    const Placement p = rules::linear_partial(call, m);
    rows.push_back(Row{{p, p, Replicate()}, {p}});
  }
  return rows;
}

}  // namespace

void registerPointwiseRules(RuleRegistry& r) {
  using rules::Linearity;
  for (const char* op : {"aten::masked_fill.Scalar", "aten::masked_fill_.Scalar"})
    r.add(op, maskedFillRows, pointwiseShape);
  addAll(r, {"aten::add.Tensor", "aten::add_.Tensor", "aten::add.out", "aten::sub.Tensor",
             "aten::sub_.Tensor", "aten::neg", "aten::neg_", "aten::clone", "aten::_to_copy",
             "aten::alias", "aten::detach", "aten::lerp.Scalar", "aten::lerp_.Scalar",
             "aten::mul.Scalar", "aten::mul_.Scalar", "aten::div.Scalar", "aten::div_.Scalar",
             "aten::zero_"},
         Linearity::Linear);
  addAll(r, {"aten::mul.Tensor", "aten::mul_.Tensor"}, Linearity::Multilinear);
  addAll(r, {"aten::div.Tensor", "aten::div_.Tensor"}, Linearity::FirstArg);
  for (const char* op : {"aten::addcmul", "aten::addcmul_"}) r.add(op, addcmulRows, pointwiseShape);
  for (const char* op : {"aten::addcdiv", "aten::addcdiv_"}) r.add(op, addcdivRows, pointwiseShape);
  addAll(r,
         {"aten::exp", "aten::exp_", "aten::log", "aten::sqrt", "aten::sqrt_", "aten::rsqrt",
          "aten::pow.Tensor_Scalar", "aten::pow_.Scalar", "aten::pow.Tensor_Tensor",
          "aten::abs", "aten::sin", "aten::cos", "aten::tanh", "aten::sigmoid", "aten::relu",
          "aten::relu_", "aten::gelu", "aten::silu", "aten::silu_", "aten::sign",
          "aten::reciprocal", "aten::maximum", "aten::minimum", "aten::maximum.out",
          "aten::minimum.out", "aten::clamp",
          "aten::clamp_", "aten::clamp_min", "aten::clamp_max", "aten::where.self",
          "aten::eq.Tensor", "aten::eq.Scalar", "aten::ne.Scalar", "aten::gt.Scalar",
          "aten::lt.Scalar", "aten::ge.Scalar", "aten::le.Scalar", "aten::logical_not",
          "aten::isnan",
          "aten::threshold_backward", "aten::sigmoid_backward", "aten::tanh_backward",
          "aten::silu_backward", "aten::gelu_backward", "aten::fill_.Scalar",
          "aten::mul.out", "aten::sqrt.out", "aten::div.out", "aten::rsub.Scalar",
          "aten::sub.Scalar", "aten::pow.Scalar", "aten::nan_to_num", "aten::erf",
          "aten::exp2", "aten::log1p", "aten::expm1", "aten::logical_and", "aten::bitwise_and.Tensor",
          "aten::sgn", "aten::square", "aten::add.Scalar", "aten::add_.Scalar", "aten::bitwise_not",
          "aten::gt.Tensor", "aten::lt.Tensor", "aten::ge.Tensor", "aten::le.Tensor", "aten::ne.Tensor",
          "aten::where.ScalarOther", "aten::where.ScalarSelf", "aten::logical_or", "aten::logical_xor",
          "aten::logical_and_", "aten::logical_or_", "aten::logical_xor_",
          "aten::bitwise_or.Tensor", "aten::clamp.Tensor", "aten::masked_fill.Tensor",
          "aten::masked_fill_.Tensor", "aten::logical_not_",
          // Elementwise math, rounding, activations and their backwards, in-place forms.
          "aten::sinh", "aten::cosh", "aten::asinh", "aten::acosh", "aten::atanh", "aten::asin", "aten::acos",
          "aten::atan", "aten::erfc", "aten::log2", "aten::log10", "aten::logit", "aten::floor", "aten::ceil",
          "aten::round", "aten::trunc", "aten::frac", "aten::atan2", "aten::hypot", "aten::fmax", "aten::fmin",
          "aten::copysign.Tensor", "aten::copysign.Scalar", "aten::lerp.Tensor", "aten::xlogy.Tensor",
          "aten::fmod.Scalar", "aten::remainder.Scalar", "aten::hardtanh", "aten::hardsigmoid",
          "aten::hardswish", "aten::elu", "aten::leaky_relu", "aten::softplus", "aten::mish",
          "aten::hardtanh_backward", "aten::hardsigmoid_backward", "aten::hardswish_backward",
          "aten::elu_backward", "aten::leaky_relu_backward", "aten::softplus_backward", "aten::mish_backward",
          "aten::logit_backward", "aten::sin_", "aten::cos_", "aten::tanh_", "aten::sigmoid_", "aten::abs_",
          "aten::floor_", "aten::ceil_", "aten::round_", "aten::trunc_", "aten::erf_", "aten::log_",
          "aten::hardtanh_", "aten::leaky_relu_"},
         Linearity::None);
}

}  // namespace dtp
