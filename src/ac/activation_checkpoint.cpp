// checkpoint and checkpoint_wrapper: activation checkpointing.
#include "dtp/ac/activation_checkpoint.h"

#include "comm/result_tape.h"
#include "dtensor/grad_reduction.h"
#include "dtensor/random_state.h"
#include "nn/applied.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <memory>

namespace dtp {
namespace {

using torch::autograd::variable_list;

// NOTE: [Checkpoint] As PyTorch's reentrant checkpoint:
// - the first pass runs fn without grad, on detached inputs, and its
//   outputs become outputs of one node whose edges are the inputs';
// - that node's backward restores the random state of the first pass (the
//   DTensor generator with its sync bookkeeping, ATen's default generator,
//   the data-parallel batch: get_random_state), runs fn again with grad on
//   detached inputs, restores the random state it found, and runs a nested
//   backward from the recomputed outputs: parameters used inside get their
//   gradients there (the styles' hooks and keep_grad_placements work as in
//   any backward; NOTE: [Buckets of a nested backward]), and the inputs'
//   gradients are returned.
// Selective mode records the first pass's collectives and DTensor matrix
// products on tapes (NOTE: [Result tape]) and replays them in the
// recomputation, which then communicates nothing and multiplies no
// DTensor matrices; it keeps those outputs alive until backward.
struct CheckpointBackward : torch::autograd::Node {
  CheckpointFn fn;
  std::vector<at::Tensor> inputs;  // detached
  std::vector<int64_t> versions;
  std::vector<bool> needs_grad;
  detail::RandomState random;
  std::shared_ptr<detail::ResultTape> collectives, products;

  std::string name() const override { return "dtp::CheckpointBackward"; }

  variable_list apply(variable_list&& grads) override {
    for (size_t i = 0; i < inputs.size(); ++i)
      TORCH_CHECK(!inputs[i].defined() || inputs[i]._version() == versions[i], "checkpoint: input ", i,
                  " was changed in place after the checkpointed call; backward would recompute from the new "
                  "values. Pass a copy (clone()) to the checkpointed function, or change a copy.");
    std::vector<at::Tensor> x;
    for (size_t i = 0; i < inputs.size(); ++i) {
      at::Tensor t = inputs[i].defined() ? inputs[i].detach() : at::Tensor();
      if (needs_grad[i]) t.requires_grad_(true);
      x.push_back(t);
    }
    std::vector<at::Tensor> outs;
    {
      const detail::RandomState now = detail::get_random_state();
      detail::set_random_state(random);
      struct Restore {
        const detail::RandomState& state;
        ~Restore() {
          detail::set_random_state(state);
        }
      } restore{now};
      detail::RecomputeScope recomputing;
      at::AutoGradMode grad(true);
      if (collectives) {
        collectives->start_replay();
        products->start_replay();
      }
      detail::TapeScope c(collectives.get()), p(products.get(), detail::TapeKind::SavedOps);
      outs = fn(x);
    }
    std::vector<at::Tensor> roots, root_grads;
    for (size_t k = 0; k < outs.size() && k < grads.size(); ++k) {
      if (!grads[k].defined() || !outs[k].defined() || !outs[k].requires_grad()) continue;
      roots.push_back(outs[k]);
      root_grads.push_back(grads[k]);
    }
    if (!roots.empty()) {
      detail::OuterBackwardScope outer;  // TP's Partial gradients reduce once, with this backward's
      torch::autograd::backward(roots, root_grads);
    }
    variable_list result;
    for (size_t i = 0; i < x.size(); ++i) result.push_back(needs_grad[i] ? x[i].grad() : at::Tensor());
    return result;
  }
};

}  // namespace

bool in_checkpoint_recompute() { return detail::in_recompute(); }

std::vector<std::string> default_sac_save_ops() { return {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}; }

std::vector<at::Tensor> checkpoint(const CheckpointFn& fn, const std::vector<at::Tensor>& inputs, ACMode mode,
                                   const std::vector<std::string>& save_ops) {
  for (const auto& op : save_ops)
    TORCH_CHECK(op.find("::") != std::string::npos, "checkpoint: save_ops entry '", op, "' is not an operator's "
                "qualified name. Name ops as their schemas do, e.g. \"aten::mm\".");
  if (!at::GradMode::is_enabled()) return fn(inputs);  // no backward: nothing to save or recompute
  auto node = std::make_shared<CheckpointBackward>();
  node->fn = fn;
  node->random = detail::get_random_state();
  for (const auto& t : inputs) {  // an undefined input (an absent optional argument) stays undefined
    node->inputs.push_back(t.defined() ? t.detach() : at::Tensor());
    node->versions.push_back(t.defined() ? static_cast<int64_t>(t._version()) : 0);
    node->needs_grad.push_back(t.defined() && t.requires_grad());
  }
  if (mode == ACMode::Selective) {
    node->collectives = std::make_shared<detail::ResultTape>();
    node->products = std::make_shared<detail::ResultTape>(save_ops);
  }
  std::vector<at::Tensor> outs;
  {
    at::NoGradGuard no_grad;
    detail::CheckpointFirstPassScope first_pass;
    detail::TapeScope c(node->collectives.get()), p(node->products.get(), detail::TapeKind::SavedOps);
    outs = fn(node->inputs);
  }
  for (const auto& o : outs)
    TORCH_CHECK(!o.defined() || at::isFloatingType(o.scalar_type()), "checkpoint: the checkpointed function returned ",
                c10::toString(o.scalar_type()), "; it must return floating-point tensors (what backward can flow "
                "through) or undefined ones (an absent optional output).");
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  for (auto& o : outs) {  // an undefined output keeps its slot among the node's outputs
    if (o.defined()) torch::autograd::set_history(o, node);
    else node->add_input_metadata(torch::autograd::Node::undefined_input());
  }
  return outs;
}

void checkpoint_wrapper(torch::nn::Module& module, ACMode mode, std::vector<std::string> save_ops) {
  nn::HookHost& host = detail::hooks_of(module, detail::technique::kCheckpointWrapper);
  TORCH_CHECK(!detail::was_applied(module, detail::technique::kCheckpointWrapper), "checkpoint_wrapper: ", module.name(),
              " is already checkpointed. Wrap each module once.");
  host.wrappers.push_back([mode, save_ops](const std::vector<at::Tensor>& inputs, const nn::HookHost::Run& run) {
    return checkpoint(run, inputs, mode, save_ops);
  });
  host.applied.push_back({detail::technique::kCheckpointWrapper, std::make_shared<ACMode>(mode)});
}

}  // namespace dtp
