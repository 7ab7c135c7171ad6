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
//  - at the DTensor key (reached directly under InferenceMode): the
//    fallback, whose "fused products" step (decompose_product) runs the
//    decomposition unless the shapes fuse (NOTE: [Which products fuse]);
//    those run as one DTensor op by the op's rule (rules/matrix.cpp).
// The fallback runs ATen's op on the local shards, i.e. the same local ops
// as the decomposition: the values are the same bit for bit.
// dtp::nn::rms_norm (six DTensor ops: pow, mean, add, rsqrt, mul, mul) is
// fused the same way, without an ATen op of its own: with no tape, an input
// sharded on any dim but the normalized last one (or replicated) and a
// replicated weight, each rank normalizes its own rows: the same local ops,
// no DTensor op at all (fused_rms_norm). With a graph, see
// NOTE: [Fused ops under autograd].
#include "dtensor/fused_ops.h"
#include "dtp/fused_ops.h"

#include "dtensor/dispatch_context.h"
#include "dtensor/dtensor_impl.h"
#include "dtensor/explicit_redistribute.h"
#include "dtensor/local_linear.h"
#include "dtensor/redistribute.h"

#include "comm/result_tape.h"
#include "comm/trace_span.h"

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

// Inside a DecomposeFusedOpsGuard on this thread (NOTE: [Dispatch context]).
bool decomposeFused() { return dispatch_context().decompose_fused.get(false); }

// The fused graph's gradients are wrapped without history: a backward that
// records a graph of its own (create_graph=true) would lose the second
// derivative silently.
void refuseCreateGraph(const char* node) {
  TORCH_CHECK(!at::GradMode::is_enabled(), "dtp: backward with create_graph=true through ", node,
              ", an op dtp ran fused on DTensors (NOTE: [Fused ops under autograd]): its gradient is not "
              "differentiable again. Run that forward under dtp::DecomposeFusedOpsGuard (each piece a DTensor "
              "op, differentiable twice), or use create_graph=false.");
}

bool recordsGraph(std::initializer_list<const at::Tensor*> inputs) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : inputs)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

bool taped() {
  return active_tape(TapeKind::Collectives) != nullptr || active_tape(TapeKind::SavedOps) != nullptr;
}

// NOTE: [Fused ops under autograd]
// In training, dtp::nn::rms_norm is six DTensor ops and its backward about
// ten; a bias-free aten::linear, or aten::matmul by a 2-D weight (libtorch's
// Linear: input.matmul(weight.t())), decomposes into view, mm, _unsafe_view
// (and t) and about seven more in its backward. Each costs dispatch on every rank (the
// two were over half of a reference Llama step's DTensor ops). Both are
// local to each shard and linear in the output's gradient, so each runs on
// the shards as one plain graph instead, as local_map would run it: the
// input x and the weight enter as local aliases whose node
// (dtp::FusedInBackward, one for both) wraps their local gradients into DTensors; the
// plain ops record an ordinary autograd graph; the output is wrapped, and
// its node (dtp::FusedOutBackward) hands the local part of the output's
// gradient to that graph. The engine runs it all in one pass, the same
// kernels as on one device: the values equal the decomposition's bit for bit
// where the output's gradient comes in the placement planned for it (else it
// is redistributed first, where the decomposition may reduce later: equal to
// rounding). Each mesh dim has a plan (FusedGradPlan), the placements the
// decomposition's propagation gives:
//  - rms_norm, x Shard(d) (d not the normalized last dim): output and
//    gradients Shard(d), the weight's gradient Partial(sum) (each rank summed
//    its own rows). x Replicate: all Replicate.
//  - linear (weight [out, in]; matmul's [in, out] the same, dims swapped):
//    x Replicate and weight Shard(0) (column-wise): output Shard(-1), x's
//    gradient Partial(sum), the weight's Shard(0); x Shard(-1) and weight
//    Shard(1) (row-wise): output Partial(sum), its gradient Replicate, x's
//    Shard(-1), the weight's Shard(1); x Shard(d), d < -1, and weight
//    Replicate: output and x's gradient Shard(d), the weight's Partial(sum);
//    both Replicate: all Replicate.
//  - Where x and the weight are Replicate, a Partial(sum) gradient of the
//    output stays partial (the backward is linear in it) and makes both
//    gradients Partial(sum); this is decided by the output node when the
//    gradient arrives (the input nodes run after it: they are reached only
//    through it).
// Other placements (a Partial input, a sharded normalized dim, a bias) run
// the decomposition, as do activation-checkpointing tapes (both passes must
// make the same DTensor ops), explicit-redistribution mode (which names the
// redistributions the decomposition makes) and DecomposeFusedOpsGuard. The
// graph holds what the decomposition's nodes would have saved. Its
// gradients are wrapped without history: a backward with create_graph=true
// is refused (refuseCreateGraph), naming the guard.
struct FusedGradPlan {
  Placements grad_out, x, weight;
  std::vector<bool> partial_passes;  // mesh dims where a Partial(sum) gradient stays partial
};

// The input gradients' placements of the backward pass under way, settled
// by the output node (again on each pass: retain_graph may bring another
// gradient placement).
struct FusedGradPlacements {
  Placements x, weight;
};

// `like` itself where it already says `placements`, `shape` and `dtype` (no
// new spec to build on every step); else a new spec on its mesh.
SpecPtr specAs(const SpecPtr& like, const Placements& placements, const std::vector<int64_t>& shape,
               c10::ScalarType dtype) {
  if (placements == like->placements && shape == like->shape && dtype == like->dtype) return like;
  return make_spec(like->mesh, placements, shape, dtype);
}

struct FusedOutBackward : torch::autograd::Node {
  const char* what = nullptr;  // the fused op, for errors
  FusedGradPlan plan;
  std::shared_ptr<FusedGradPlacements> decided;
  std::string name() const override { return "dtp::FusedOutBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    refuseCreateGraph(what);
    const at::Tensor& g = grads[0];
    if (!g.defined()) return {at::Tensor()};
    const DTensorImpl* gi = maybeGetDTensorImpl(g);
    TORCH_INTERNAL_ASSERT(gi != nullptr, name(), ": the gradient is not a DTensor");
    const DTensorSpec& gs = gi->spec();
    Placements want = plan.grad_out;
    *decided = {plan.x, plan.weight};
    for (size_t m = 0; m < want.size(); ++m) {
      const Placement& have = gs.placements[m];
      if (plan.partial_passes[m] && have.is_partial() && have.op == ReduceOp::Sum)
        want[m] = decided->x[m] = decided->weight[m] = have;
    }
    if (gs.placements == want) return {gi->local()};
    return {redistribute_local(gi->local(), gs, want, /*backward=*/true, solely_owned(g))};
  }
};

// The node of both local inputs (x's and the weight's alias, in that order
// among those that require grad): wraps their local gradients.
struct FusedInBackward : torch::autograd::Node {
  SpecPtr x_spec, weight_spec;
  bool x_grad = false, weight_grad = false;
  std::shared_ptr<const FusedGradPlacements> decided;
  std::string name() const override { return "dtp::FusedInBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    torch::autograd::variable_list out(2);
    size_t next = 0;
    auto wrap = [&](const SpecPtr& spec, const Placements& placements) {
      const at::Tensor& g = grads[next++];
      if (!g.defined()) return at::Tensor();
      return makeDTensor(g, specAs(spec, placements, spec->shape, g.scalar_type()));
    };
    if (x_grad) out[0] = wrap(x_spec, decided->x);
    if (weight_grad) out[1] = wrap(weight_spec, decided->weight);
    return out;
  }
};

// The local aliases of x and the weight that enter the plain graph, their
// gradients going back to them through one FusedInBackward.
std::pair<at::Tensor, at::Tensor> enterLocal(const at::Tensor& x, const at::Tensor& weight,
                                             const std::shared_ptr<FusedGradPlacements>& decided) {
  const DTensorImpl &xi = *unsafeGetDTensorImpl(x), &wi = *unsafeGetDTensorImpl(weight);
  std::pair<at::Tensor, at::Tensor> local{detached_alias(xi.local()), detached_alias(wi.local())};
  if (!x.requires_grad() && !weight.requires_grad()) return local;
  auto node = std::make_shared<FusedInBackward>();
  node->x_spec = xi.spec_ptr();
  node->weight_spec = wi.spec_ptr();
  node->x_grad = x.requires_grad();
  node->weight_grad = weight.requires_grad();
  node->decided = decided;
  node->set_next_edges(torch::autograd::collect_next_edges(x, weight));
  if (node->x_grad) torch::autograd::set_history(local.first, node);
  if (node->weight_grad) torch::autograd::set_history(local.second, node);
  return local;
}

// Runs `local` (plain tensors in, a plain tensor out, recording a graph) on
// the shards of x and the weight and wraps its result as `out` placements
// of `out_shape` (NOTE: [Fused ops under autograd]).
// Profilers see it as "DTensor fused <what> (x's, the weight's placements)
// -> (the output's)" (NOTE: [Trace spans]).
template <class Local>
at::Tensor fusedGraph(const char* what, const at::Tensor& x, const at::Tensor& weight, const Placements& out,
                      const std::vector<int64_t>& out_shape, FusedGradPlan plan, Local&& local) {
  const SpecPtr& x_spec = unsafeGetDTensorImpl(x)->spec_ptr();
  const DTensorSpec& xs = *x_spec;
  const detail::TraceSpan span([&] {
    return c10::str("DTensor fused ", what, " (", to_string(xs.placements), ", ",
                    to_string(unsafeGetDTensorImpl(weight)->spec().placements), ") -> (", to_string(out), ")");
  });
  auto decided = std::make_shared<FusedGradPlacements>();
  const auto [lx, lw] = enterLocal(x, weight, decided);
  const at::Tensor lout = local(lx, lw);
  SpecPtr spec = specAs(x_spec, out, out_shape, lout.scalar_type());
  auto node = std::make_shared<FusedOutBackward>();
  node->what = what;
  node->plan = std::move(plan);
  node->decided = std::move(decided);
  node->set_next_edges({torch::autograd::impl::gradient_edge(lout)});
  at::Tensor result = makeDTensor(detached_alias(lout), std::move(spec));
  torch::autograd::set_history(result, node);
  return result;
}

// Whether x and the weight are DTensors on one mesh that a fused graph may
// take: a graph is recorded, no tape, not in explicit-redistribution mode.
bool fusableWithGraph(const DTensorImpl* xi, const DTensorImpl* wi, const at::Tensor& x, const at::Tensor& weight) {
  return xi != nullptr && wi != nullptr && !decomposeFused() && recordsGraph({&x, &weight}) && !taped() &&
         !explicit_redistribute_active() && xi->spec().mesh == wi->spec().mesh;
}

// x times a 2-D weight as a fused graph, where every mesh dim has a plan;
// else undefined. `transposed`: linear's weight [out, in]; else matmul's
// [in, out] (libtorch's Linear computes input.matmul(weight.t())).
at::Tensor fusedProduct(const at::Tensor& x, const at::Tensor& weight, bool transposed) {
  const DTensorImpl* xi = maybeGetDTensorImpl(x);
  const DTensorImpl* wi = maybeGetDTensorImpl(weight);
  const int64_t out_dim = transposed ? 0 : 1, in_dim = 1 - out_dim;
  const FusedProduct kind = transposed ? FusedProduct::Linear : FusedProduct::Matmul;
  // A contraction of unequal sizes is left to the decomposition's error.
  if (!fusableWithGraph(xi, wi, x, weight) || !fuses_as_product(kind, x.dim(), weight.dim()) ||
      x.size(-1) != weight.size(in_dim))
    return {};
  const int64_t last = x.dim() - 1;
  const Placements& px = xi->spec().placements;
  const Placements& pw = wi->spec().placements;
  const size_t n = px.size();
  Placements out(n, Replicate());
  FusedGradPlan plan{Placements(n, Replicate()), Placements(n, Replicate()), Placements(n, Replicate()),
                     std::vector<bool>(n, false)};
  for (size_t m = 0; m < n; ++m) {
    const Placement &a = px[m], &b = pw[m];
    if (a.is_replicate() && b.is_shard() && b.dim == out_dim) {  // column-wise
      out[m] = plan.grad_out[m] = Shard(last);
      plan.x[m] = Partial(ReduceOp::Sum);
      plan.weight[m] = b;
    } else if (a.is_shard() && a.dim == last && b.is_shard() && b.dim == in_dim) {  // row-wise
      out[m] = Partial(ReduceOp::Sum);
      plan.x[m] = a;
      plan.weight[m] = b;
    } else if (a.is_shard() && a.dim < last && b.is_replicate()) {  // rows of x
      out[m] = plan.grad_out[m] = plan.x[m] = a;
      plan.weight[m] = Partial(ReduceOp::Sum);
    } else if (a.is_replicate() && b.is_replicate()) {
      plan.partial_passes[m] = true;
    } else {
      return {};
    }
  }
  std::vector<int64_t> shape = xi->spec().shape;
  shape.back() = weight.size(out_dim);
  return fusedGraph(transposed ? "aten::linear" : "aten::matmul", x, weight, out, shape,
                    std::move(plan), [transposed](const at::Tensor& lx, const at::Tensor& lw) {
                      // See NOTE: [One-row linear] (a graph is recorded here: ATen's op).
                      return transposed ? local_linear(lx, lw, at::Tensor()) : local_matmul(lx, lw);
                    });
}

at::Tensor linearAutograd(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const at::Tensor none;
  if (decomposeFused() || recordsGraph({&input, &weight, bias ? &*bias : &none}) || taped()) {
    if (!bias || !bias->defined()) {
      at::Tensor fused = fusedProduct(input, weight, /*transposed=*/true);
      if (fused.defined()) return fused;
    }
    return at::native::linear(input, weight, bias);
  }
  return at::_ops::linear::redispatch(kDTensorKey, input, weight, bias);
}

at::Tensor matmulAutograd(const at::Tensor& self, const at::Tensor& other) {
  if (decomposeFused() || recordsGraph({&self, &other}) || taped()) {
    at::Tensor fused = fusedProduct(self, other, /*transposed=*/false);
    return fused.defined() ? fused : at::native::matmul(self, other);
  }
  return at::_ops::matmul::redispatch(kDTensorKey, self, other);
}

}  // namespace

FusedProduct fused_product_of(const c10::OperatorHandle& op) {
  const auto& name = op.operator_name();
  if (!name.overload_name.empty()) return FusedProduct::None;
  if (name.name == "aten::linear") return FusedProduct::Linear;
  if (name.name == "aten::matmul") return FusedProduct::Matmul;
  return FusedProduct::None;
}

bool decompose_product(FusedProduct kind, torch::jit::Stack& stack) {
  if (kind == FusedProduct::Linear) {
    if (!decomposeFused() && fuses_as_product(kind, torch::jit::peek(stack, 0, 3).toTensor().dim(),
                                              torch::jit::peek(stack, 1, 3).toTensor().dim()))
      return false;
    auto bias = torch::jit::pop(stack).toOptional<at::Tensor>();
    at::Tensor weight = torch::jit::pop(stack).toTensor(), input = torch::jit::pop(stack).toTensor();
    torch::jit::push(stack, at::native::linear(input, weight, bias));
    return true;
  }
  TORCH_INTERNAL_ASSERT(kind == FusedProduct::Matmul);
  if (!decomposeFused() && fuses_as_product(kind, torch::jit::peek(stack, 0, 2).toTensor().dim(),
                                            torch::jit::peek(stack, 1, 2).toTensor().dim()))
    return false;
  at::Tensor other = torch::jit::pop(stack).toTensor(), self = torch::jit::pop(stack).toTensor();
  torch::jit::push(stack, at::native::matmul(self, other));
  return true;
}

at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, LocalRmsNorm local) {
  const DTensorImpl* xi = maybeGetDTensorImpl(x);
  const DTensorImpl* wi = maybeGetDTensorImpl(weight);
  if (xi == nullptr || wi == nullptr || decomposeFused() || x.dim() == 0 || weight.dim() != 1 ||
      weight.size(0) != x.size(-1) || taped() || !(xi->spec().mesh == wi->spec().mesh))
    return {};
  const bool graph = recordsGraph({&x, &weight});
  if (graph && explicit_redistribute_active()) return {};  // the rest of fusableWithGraph is checked above
  const DTensorSpec& xs = xi->spec();
  for (const Placement& p : xs.placements)
    if (p.is_partial() || (p.is_shard() && p.dim == x.dim() - 1)) return {};
  for (const Placement& p : wi->spec().placements)
    if (!p.is_replicate()) return {};
  if (!graph) {
    at::Tensor out = local(xi->local(), wi->local(), eps);
    SpecPtr spec = specAs(xi->spec_ptr(), xs.placements, xs.shape, out.scalar_type());
    return makeDTensor(std::move(out), std::move(spec));
  }
  const size_t n = xs.placements.size();
  FusedGradPlan plan{xs.placements, xs.placements, Placements(n, Replicate()), std::vector<bool>(n, false)};
  for (size_t m = 0; m < n; ++m) {
    if (xs.placements[m].is_shard()) plan.weight[m] = Partial(ReduceOp::Sum);
    else plan.partial_passes[m] = true;
  }
  return fusedGraph("dtp::rms_norm", x, weight, xs.placements, xs.shape, std::move(plan),
                    [&](const at::Tensor& lx, const at::Tensor& lw) { return local(lx, lw, eps); });
}

void register_fused_ops() {
  static auto* autograd = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::AutogradPrivateUse1,
                                             __FILE__, __LINE__);
  autograd->impl("linear", TORCH_FN(linearAutograd));
  autograd->impl("matmul", TORCH_FN(matmulAutograd));
}

}  // namespace dtp::detail

namespace dtp {

DecomposeFusedOpsGuard::DecomposeFusedOpsGuard() { detail::dispatch_context().decompose_fused.enter(this, true); }
DecomposeFusedOpsGuard::~DecomposeFusedOpsGuard() { detail::dispatch_context().decompose_fused.leave(this); }
bool DecomposeFusedOpsGuard::enabled() { return detail::dispatch_context().decompose_fused.get(false); }

}  // namespace dtp
