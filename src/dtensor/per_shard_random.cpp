// RandomMode::PerShard draws: the checks every per-shard draw makes, and
// dtp::per_shard::*, the same draws on plain tensors (the one-device
// reference). NOTE: [Per-shard random numbers] in philox.h.
#include "dtensor/philox.h"
#include "dtensor/random_state.h"
#include "dtp/dtensor_spec.h"
#include "dtp/random.h"

#include <ATen/ATen.h>

#include <optional>

namespace dtp {

void detail::draw_per_shard(const std::string& op, at::Tensor& out, const PhiloxDraw& draw, c10::IntArrayRef shape,
                            c10::IntArrayRef box_offset, const DeviceMesh* mesh) {
  const c10::ScalarType dtype = out.scalar_type();
  if (draw.kind == DrawKind::Bernoulli) {
    TORCH_CHECK(!c10::isComplexType(dtype), "dtp: ", op, " under RandomMode::PerShard: got dtype ",
                short_dtype_name(dtype), ", expected a real or bool dtype. NYI: complex draws; use "
                "RandomMode::Global for them.");
    TORCH_CHECK(draw.probs.defined() || (draw.a >= 0 && draw.a <= 1), "dtp: ", op, ": got p = ", draw.a,
                ", expected 0 <= p <= 1.");
  } else {
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16,
                "dtp: ", op, " under RandomMode::PerShard: got dtype ", short_dtype_name(dtype),
                ", expected f32, f64, f16 or bf16. NYI: integer draws; use RandomMode::Global for them.");
    if (draw.kind == DrawKind::Uniform) {
      TORCH_CHECK(draw.a <= draw.b, "dtp: ", op, ": got from = ", draw.a, ", to = ", draw.b, ", expected from <= to.");
    } else {
      TORCH_CHECK(draw.b >= 0, "dtp: ", op, ": got std = ", draw.b, ", expected std >= 0.");
    }
  }
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  const PhiloxState st = take_philox(mesh, philox_blocks(draw.kind, dtype, numel));
  philox_fill(out, draw, shape, box_offset, st.seed, st.offset);
}

namespace per_shard {
namespace {

// `draw` over the whole of `like`'s shape into a new contiguous tensor.
at::Tensor whole(const std::string& op, const at::Tensor& like, const detail::PhiloxDraw& draw,
                 std::optional<c10::ScalarType> dtype = std::nullopt) {
  at::Tensor out = at::empty(like.sizes(), like.options().dtype(dtype.value_or(like.scalar_type())));
  detail::draw_per_shard(op, out, draw, like.sizes(), std::vector<int64_t>(like.dim(), 0), nullptr);
  return out;
}

}  // namespace

at::Tensor& uniform_(at::Tensor& self, double from, double to) {
  self.copy_(whole("aten::uniform_", self, {detail::DrawKind::Uniform, from, to}));
  return self;
}

at::Tensor& normal_(at::Tensor& self, double mean, double std) {
  self.copy_(whole("aten::normal_", self, {detail::DrawKind::Normal, mean, std}));
  return self;
}

at::Tensor& bernoulli_(at::Tensor& self, double p) {
  self.copy_(whole("aten::bernoulli_.float", self, {detail::DrawKind::Bernoulli, p}));
  return self;
}

at::Tensor bernoulli(const at::Tensor& probs) {
  detail::PhiloxDraw draw{detail::DrawKind::Bernoulli};
  draw.probs = probs.contiguous();
  return whole("aten::bernoulli", probs, draw);
}

at::Tensor bernoulli(const at::Tensor& self, double p) {
  return whole("aten::bernoulli.p", self, {detail::DrawKind::Bernoulli, p});
}

at::Tensor rand_like(const at::Tensor& self) { return whole("aten::rand_like", self, {detail::DrawKind::Uniform, 0., 1.}); }

at::Tensor randn_like(const at::Tensor& self) { return whole("aten::randn_like", self, {detail::DrawKind::Normal, 0., 1.}); }

// The same expression as the native_dropout rule (rules/random.cpp).
std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p) {
  const double p1m = 1. - p;
  const double scale = p1m == 0 ? 0. : 1. / p1m;
  at::Tensor mask = whole("aten::native_dropout", input, {detail::DrawKind::Bernoulli, p1m}, at::kBool);
  return {input.mul(mask).mul_(scale), mask};
}

at::Tensor dropout(const at::Tensor& input, double p) {
  TORCH_CHECK(p >= 0 && p <= 1, "dtp: per_shard::dropout: got p = ", p, ", expected 0 <= p <= 1.");
  // ATen's at::dropout (Dropout.cpp): the fused kernel where it applies, else
  // a noise tensor.
  if (input.is_cuda() && p > 0 && p < 1 && input.numel() > 0) return std::get<0>(native_dropout(input, p));
  if (p == 0 || input.numel() == 0) return input;
  if (p == 1) return input.mul(at::zeros({}, input.options()));
  at::Tensor noise = at::empty_like(input);
  bernoulli_(noise, 1 - p);
  noise.div_(1 - p);
  return input.mul(noise);
}

}  // namespace per_shard
}  // namespace dtp
