// NOTE: [Fused ops without autograd]
// aten::linear and aten::matmul are CompositeImplicitAutograd: on DTensors
// they decompose above the DTensor key (matmul of [b, s, k] by [k, n] into
// reshape, mm and view), several DTensor ops where a plain program pays for
// one call. Autograd needs those pieces: each records its backward. With no
// graph to record (no grad mode, or no input that requires grad), they only
// cost dispatch: in a decode step of the reference Llama they were half of
// the DTensor ops. So for DTensors each gets two kernels of its own:
//  - at the autograd key: the decomposition, as ATen's own kernel, when a
//    graph is recorded or an activation-checkpointing tape is active (the
//    recomputation, which has gradients, must replay the first pass's ops
//    and collectives); else on to the DTensor key;
//  - at the DTensor key (reached directly under InferenceMode): one DTensor
//    op through the fallback and the op's rule (rules/matrix.cpp), for the
//    shapes the rule models (a 2-D weight or right operand); else the
//    decomposition.
// The fallback runs ATen's op on the local shards, i.e. the same local ops
// as the decomposition: the values are the same bit for bit.
// dtp::nn::rms_norm (six DTensor ops: pow, mean, add, rsqrt, mul, mul) is
// fused the same way, without an ATen op of its own: with no graph and no
// tape, an input sharded on any dim but the normalized last one (or
// replicated) and a replicated weight, each rank normalizes its own rows:
// the same local ops, no DTensor op at all (fused_rms_norm).
#include "dtensor/fused_ops.h"

#include "dtensor/dispatch.h"
#include "dtensor/dtensor_impl.h"

#include "comm/collective_tape.h"

#include <ATen/ATen.h>
#include <ATen/core/stack.h>
#include <ATen/ops/linear_native.h>
#include <ATen/ops/linear_ops.h>
#include <ATen/ops/matmul_native.h>
#include <ATen/ops/matmul_ops.h>
#include <torch/library.h>

namespace dtp::detail {
namespace {

const c10::DispatchKeySet kDTensorKey(c10::DispatchKey::PrivateUse1);

bool recordsGraph(std::initializer_list<const at::Tensor*> inputs) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : inputs)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

bool taped() {
  return active_tape(TapeKind::Collectives) != nullptr || active_tape(TapeKind::SavedOps) != nullptr;
}

at::Tensor linearAutograd(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const at::Tensor none;
  if (recordsGraph({&input, &weight, bias ? &*bias : &none}) || taped()) return at::native::linear(input, weight, bias);
  return at::_ops::linear::redispatch(kDTensorKey, input, weight, bias);
}

void linearDTensor(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (torch::jit::peek(*stack, 1, 3).toTensor().dim() == 2) return dtensor_fallback(op, stack);
  auto bias = torch::jit::pop(*stack).toOptional<at::Tensor>();
  at::Tensor weight = torch::jit::pop(*stack).toTensor(), input = torch::jit::pop(*stack).toTensor();
  torch::jit::push(*stack, at::native::linear(input, weight, bias));
}

at::Tensor matmulAutograd(const at::Tensor& self, const at::Tensor& other) {
  if (recordsGraph({&self, &other}) || taped()) return at::native::matmul(self, other);
  return at::_ops::matmul::redispatch(kDTensorKey, self, other);
}

void matmulDTensor(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (torch::jit::peek(*stack, 0, 2).toTensor().dim() >= 2 && torch::jit::peek(*stack, 1, 2).toTensor().dim() == 2)
    return dtensor_fallback(op, stack);
  at::Tensor other = torch::jit::pop(*stack).toTensor(), self = torch::jit::pop(*stack).toTensor();
  torch::jit::push(*stack, at::native::matmul(self, other));
}

}  // namespace

at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, LocalRmsNorm local) {
  const DTensorImpl* xi = maybeGetDTensorImpl(x);
  const DTensorImpl* wi = maybeGetDTensorImpl(weight);
  if (xi == nullptr || wi == nullptr || x.dim() == 0 || weight.dim() != 1 || weight.size(0) != x.size(-1) ||
      recordsGraph({&x, &weight}) || taped())
    return {};
  const DTensorSpec& xs = xi->spec();
  if (!(xs.mesh == wi->spec().mesh)) return {};
  for (const Placement& p : xs.placements)
    if (p.is_partial() || (p.is_shard() && p.dim == x.dim() - 1)) return {};
  for (const Placement& p : wi->spec().placements)
    if (!p.is_replicate()) return {};
  at::Tensor out = local(xi->local(), wi->local(), eps);
  const auto dtype = out.scalar_type();
  return makeDTensor(std::move(out), make_spec(xs.mesh, xs.placements, xs.shape, dtype));
}

void register_fused_ops() {
  static auto* autograd = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::AutogradPrivateUse1,
                                             __FILE__, __LINE__);
  static auto* dtensor = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__,
                                            __LINE__);
  autograd->impl("linear", TORCH_FN(linearAutograd));
  dtensor->impl("linear", torch::CppFunction::makeFromBoxedFunction<&linearDTensor>());
  autograd->impl("matmul", TORCH_FN(matmulAutograd));
  dtensor->impl("matmul", torch::CppFunction::makeFromBoxedFunction<&matmulDTensor>());
}

}  // namespace dtp::detail
