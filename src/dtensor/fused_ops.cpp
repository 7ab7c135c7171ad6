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
// fused the same way, without an ATen op of its own: with no tape, an input
// sharded on any dim but the normalized last one (or replicated) and a
// replicated weight, each rank normalizes its own rows: the same local ops,
// no DTensor op at all (fused_rms_norm). With a graph, see
// NOTE: [Fused rms_norm under autograd].
#include "dtensor/fused_ops.h"

#include "dtensor/dispatch.h"
#include "dtensor/dtensor_impl.h"
#include "dtensor/explicit_redistribute.h"
#include "dtensor/redistribute.h"

#include "comm/collective_tape.h"

#include <ATen/ATen.h>
#include <ATen/core/stack.h>
#include <ATen/ops/linear_native.h>
#include <ATen/ops/linear_ops.h>
#include <ATen/ops/matmul_native.h>
#include <ATen/ops/matmul_ops.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
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

// NOTE: [Fused rms_norm under autograd]
// In training, the six DTensor ops of rms_norm and the ten or so of its
// backward cost dispatch on every rank (a sixth of a reference Llama step's
// DTensor ops). Their backward is linear in the gradient and local to each
// row, so the whole norm runs on the shards as one plain graph instead, as
// local_map would run it: x and the weight enter as local aliases whose
// node (dtp::FusedInBackward) wraps their local gradients into DTensors;
// the plain ops (`local`) record an ordinary autograd graph; the output is
// wrapped, and its node (dtp::FusedOutBackward) hands the local part of the
// output's gradient to that graph. The engine runs it all in one pass, the
// same kernels as on one device: the values equal the decomposition's bit
// for bit where the output's gradient comes in the placements below (a
// sharded x given a Partial gradient reduce-scatters it first, one
// collective, where the decomposition reduces later, in two: equal to
// rounding). Gradient placements, per mesh dim, as the decomposition's
// propagation gives them, decided by the output node when the gradient
// arrives (the input nodes run after it: they are reached only through it):
//  - x Shard(d): the gradient must be Shard(d) (redistributed when it is
//    not); x's gradient is Shard(d), the weight's Partial(sum) (each rank
//    summed its own rows).
//  - x Replicate: a Partial(sum) gradient stays partial (the backward is
//    linear in it: both gradients are Partial(sum)); a Replicate one gives
//    Replicate gradients; anything else is redistributed to Replicate.
// The graph holds what the decomposition's nodes would have saved. Not
// taken under an activation-checkpointing tape (both passes must make the
// same DTensor ops) nor in explicit-redistribution mode (which names the
// redistributions the decomposition makes): the decomposition runs there.
struct FusedGradPlacements {
  Placements x, weight;
};

struct FusedOutBackward : torch::autograd::Node {
  SpecPtr x_spec;
  std::shared_ptr<FusedGradPlacements> decided;
  std::string name() const override { return "dtp::FusedOutBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const at::Tensor& g = grads[0];
    if (!g.defined()) return {at::Tensor()};
    const DTensorImpl* gi = maybeGetDTensorImpl(g);
    TORCH_INTERNAL_ASSERT(gi != nullptr, name(), ": the gradient is not a DTensor");
    const DTensorSpec& gs = gi->spec();
    Placements want = x_spec->placements, weight(want.size(), Replicate());
    for (size_t m = 0; m < want.size(); ++m) {
      const Placement& have = gs.placements[m];
      if (want[m].is_replicate() && have.is_partial() && have.op == ReduceOp::Sum) want[m] = have;
      if (!want[m].is_replicate()) weight[m] = Partial(ReduceOp::Sum);
    }
    decided->x = want;
    decided->weight = std::move(weight);
    if (gs.placements == want) return {gi->local()};
    return {redistribute_local(gi->local(), gs, want, /*backward=*/true, solely_owned(g))};
  }
};

struct FusedInBackward : torch::autograd::Node {
  SpecPtr spec;
  bool weight = false;
  std::shared_ptr<const FusedGradPlacements> decided;
  std::string name() const override { return "dtp::FusedInBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const at::Tensor& g = grads[0];
    if (!g.defined()) return {at::Tensor()};
    const Placements& placements = weight ? decided->weight : decided->x;
    if (placements == spec->placements && g.scalar_type() == spec->dtype) return {makeDTensor(g, spec)};
    return {makeDTensor(g, make_spec(spec->mesh, placements, spec->shape, g.scalar_type()))};
  }
};

// The local alias of DTensor `t` that enters the plain graph: its gradient
// goes back to `t` through a FusedInBackward.
at::Tensor enterLocal(const at::Tensor& t, bool weight, const std::shared_ptr<FusedGradPlacements>& decided) {
  const DTensorImpl& impl = *unsafeGetDTensorImpl(t);
  at::Tensor local = detachedAlias(impl.local());
  if (!t.requires_grad()) return local;
  auto node = std::make_shared<FusedInBackward>();
  node->spec = impl.spec_ptr();
  node->weight = weight;
  node->decided = decided;
  node->set_next_edges(torch::autograd::collect_next_edges(t));
  torch::autograd::set_history(local, node);
  return local;
}

}  // namespace

at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, LocalRmsNorm local) {
  const DTensorImpl* xi = maybeGetDTensorImpl(x);
  const DTensorImpl* wi = maybeGetDTensorImpl(weight);
  if (xi == nullptr || wi == nullptr || x.dim() == 0 || weight.dim() != 1 || weight.size(0) != x.size(-1) || taped())
    return {};
  const bool graph = recordsGraph({&x, &weight});
  if (graph && explicit_redistribute_active()) return {};
  const DTensorSpec& xs = xi->spec();
  if (!(xs.mesh == wi->spec().mesh)) return {};
  for (const Placement& p : xs.placements)
    if (p.is_partial() || (p.is_shard() && p.dim == x.dim() - 1)) return {};
  for (const Placement& p : wi->spec().placements)
    if (!p.is_replicate()) return {};
  if (!graph) {
    at::Tensor out = local(xi->local(), wi->local(), eps);
    const auto dtype = out.scalar_type();
    return makeDTensor(std::move(out), make_spec(xs.mesh, xs.placements, xs.shape, dtype));
  }
  auto decided = std::make_shared<FusedGradPlacements>();
  const at::Tensor lout = local(enterLocal(x, false, decided), enterLocal(weight, true, decided), eps);
  auto node = std::make_shared<FusedOutBackward>();
  node->x_spec = xi->spec_ptr();
  node->decided = std::move(decided);
  node->set_next_edges({torch::autograd::impl::gradient_edge(lout)});
  at::Tensor out = makeDTensor(detachedAlias(lout), lout.scalar_type() == xs.dtype
                                                        ? xi->spec_ptr()
                                                        : make_spec(xs.mesh, xs.placements, xs.shape, lout.scalar_type()));
  torch::autograd::set_history(out, node);
  return out;
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
