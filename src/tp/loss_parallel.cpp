// loss_parallel's public face: the guard and loss_parallel_cross_entropy.
// The sharding behaviour is src/dtensor/rules/loss_parallel.cpp.
#include "dtp/tp/loss_parallel.h"

#include "dtensor/dtensor_impl.h"
#include "dtensor/rules/loss_parallel.h"
#include "dtp/dtensor.h"

#include <torch/nn/functional/loss.h>

namespace dtp {

LossParallelGuard::LossParallelGuard() : prev_(loss_parallel_enabled()) { set_loss_parallel_enabled(true); }
LossParallelGuard::~LossParallelGuard() { set_loss_parallel_enabled(prev_); }
bool LossParallelGuard::enabled() { return loss_parallel_enabled(); }

at::Tensor loss_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                       const torch::nn::functional::CrossEntropyFuncOptions& options) {
  LossParallelGuard guard;
  if (options.label_smoothing() == 0.0) {
    at::Tensor fused = fused_cross_entropy(logits, target, options.weight(),
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
