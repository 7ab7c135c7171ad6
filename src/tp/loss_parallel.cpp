// loss_parallel's public face: the guard (and the per-thread switch it
// owns), loss_parallel_cross_entropy and its fused autograd node. The
// sharding behaviour is loss_parallel_rules.cpp.
#include "dtp/tp/loss_parallel.h"

#include "dtensor/dtensor_impl.h"
#include "dtp/dtensor.h"
#include "tp/loss_parallel_rules.h"

#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/nn/functional/loss.h>

namespace dtp {
namespace {

// loss_parallel_cross_entropy on 2-D logits without label smoothing, fused:
// the same all-reduces and arithmetic as log_softmax + nll_loss (so the same
// values as one device's), without the dispatcher round trips, nll_loss's
// zero-filled gradient and, unless the graph is retained, any new
// logits-sized tensor in backward (the log-probabilities become the gradient).
struct CrossEntropyBackward : torch::autograd::Node {
  detail::NllCall call;  // the targets' rows; its logits (impl, lp) dropped
  SpecPtr spec;          // the logits'
  at::Tensor logp;       // [rows, local classes]
  at::Tensor total;      // the total weight (mean)
  int64_t reduction = at::Reduction::Mean;
  bool reuse = false;  // backward may overwrite `logp`

  std::string name() const override { return "dtp::CrossEntropyBackward"; }
  void will_release_variables() override { reuse = true; }
  void release_variables() override { logp.reset(); }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    TORCH_CHECK(logp.defined(), "loss_parallel_cross_entropy: backward ran a second time through a "
                "graph whose saved log-probabilities were freed. Pass retain_graph=true to the first backward.");
    if (!grads[0].defined()) return {at::Tensor()};
    const at::Tensor coeff = detail::row_coeff(call, spec->mesh, grads[0], total, reduction);
    // log_softmax's backward of nll_loss's gradient: softmax * coeff, minus
    // coeff at the target.
    at::Tensor grad;
    if (reuse) {
      grad = std::move(logp);
      grad.exp_();
    } else {
      grad = logp.exp();
    }
    grad.mul_(coeff.unsqueeze(1));
    if (grad.size(1) > 0) grad.scatter_add_(1, call.index, (coeff * call.here).neg_().unsqueeze(1));
    return {makeDTensor(std::move(grad), spec)};
  }
};

// cross_entropy of 2-D logits sharded on the class dim (optionally the batch
// dim), in one CrossEntropyBackward node. `reduction` is at::Reduction's.
// Undefined when the logits are not such a DTensor (the caller then takes the
// op-by-op path).
at::Tensor fusedCrossEntropy(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& weight,
                             int64_t reduction, int64_t ignore_index) {
  auto* impl = maybeGetDTensorImpl(logits);
  if (impl == nullptr || logits.dim() != 2) return {};
  const c10::IValue args[] = {logits, target, weight.defined() ? c10::IValue(weight) : c10::IValue(),
                              c10::IValue(reduction), c10::IValue(ignore_index)};
  auto c = detail::nll_call(args, /*self=*/0, /*target=*/1, /*weight=*/2, /*ignore_index=*/4, /*validate=*/true);
  if (!c) return {};
  at::Tensor logp = detail::local_log_softmax(c->lp, 1, impl->spec(), c->cs.class_dims);
  auto [out, total] = detail::nll_forward(*c, logp, reduction);
  if (logits.requires_grad() && at::GradMode::is_enabled()) {
    auto node = std::make_shared<CrossEntropyBackward>();
    node->spec = impl->spec_ptr();
    node->logp = std::move(logp);
    node->total = std::move(total);
    node->reduction = reduction;
    node->call = std::move(*c);
    node->call.impl = nullptr;
    node->call.lp.reset();
    node->set_next_edges(torch::autograd::collect_next_edges(logits));
    torch::autograd::set_history(out, node);
  }
  return out;
}

}  // namespace

// NOTE: [loss_parallel's handlers] (loss_parallel_rules.h).
LossParallelGuard::LossParallelGuard() : prev_(detail::loss_parallel_enabled()) {
  detail::register_loss_parallel_handlers();
  detail::set_loss_parallel_enabled(true);
}
LossParallelGuard::~LossParallelGuard() { detail::set_loss_parallel_enabled(prev_); }
bool LossParallelGuard::enabled() { return detail::loss_parallel_enabled(); }

at::Tensor loss_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                       const torch::nn::functional::CrossEntropyFuncOptions& options) {
  LossParallelGuard guard;
  if (options.label_smoothing() == 0.0) {
    at::Tensor fused = fusedCrossEntropy(logits, target, options.weight(),
                                         torch::enumtype::reduction_get_enum(options.reduction()),
                                         options.ignore_index());
    if (fused.defined()) return fused;
  }
  // Backward runs after the guard is gone: plain targets and weights, which
  // autograd saves, become replicated DTensors here (no communication).
  auto* impl = maybeGetDTensorImpl(logits);
  auto replicated = [&](const at::Tensor& t) {
    if (impl == nullptr || !t.defined() || t.dim() == 0 || isDTensor(t)) return t;
    const DeviceMesh& mesh = impl->spec().mesh;
    return from_local(t, mesh, Placements(mesh.ndim(), Replicate()));
  };
  auto opts = options;
  if (opts.weight().defined()) opts.weight(replicated(opts.weight()));
  return torch::nn::functional::cross_entropy(logits, replicated(target), opts);
}

}  // namespace dtp
