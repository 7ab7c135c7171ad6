// State dicts: the tensors of a module and its optimizer keyed by fully
// qualified name, as PyTorch's torch.distributed.checkpoint.state_dict makes
// them. Entries alias the live tensors (DTensors stay DTensors), so saving
// reads them and loading fills them in place.
//
//   model.layers.0.attention.wq.weight           a parameter (DTensor under TP)
//   model.layers.0.attention_norm.weight
//   optimizer.state.layers.0.attention.wq.weight.exp_avg
//   optimizer.state.layers.0.attention.wq.weight.step   (i64 scalar)
//
// Optimizers: torch::optim::AdamW (dtp::optim::AdamW too), Adam and SGD;
// their param groups' options travel as metadata ("optimizer.param_groups").
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace dtp::dcp {

struct StateDict {
  std::vector<std::pair<std::string, at::Tensor>> tensors;  // in order
  std::map<std::string, std::string> metadata;              // strings only (e.g. the step)

  void add(std::string name, at::Tensor t) { tensors.emplace_back(std::move(name), std::move(t)); }
  const at::Tensor* find(const std::string& name) const;
};

struct StateDictOptions {
  // Buffers whose name (last component) is listed are not saved, as PyTorch's
  // register_buffer(persistent=False); e.g. tables rebuilt from the config.
  std::vector<std::string> non_persistent_buffers;
  // Only the parameters and buffers whose FQN this accepts (null: all): a
  // pipeline rank's stages, whose entries it saves and loads while the other
  // ranks handle theirs. load_state then leaves the others' entries, and their
  // optimizer state, in the checkpoint. A keep that accepts none of the
  // module's entries is an error (a misspelt FQN).
  std::function<bool(const std::string& fqn)> keep;
};

// Parameters (each tensor once: a tied weight under its first name) and
// buffers of `model`, prefixed "model.".
StateDict get_model_state_dict(torch::nn::Module& model, const StateDictOptions& options = {});

// The optimizer's per-parameter state, prefixed "optimizer.state.<fqn>.", and
// its param groups as metadata. `model` names the parameters; a parameter the
// optimizer holds that `model` lacks is an error.
StateDict get_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer);

// Both, in one state dict (what save_state saves).
StateDict get_state_dict(torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                         const StateDictOptions& options = {});

// Gives every parameter listed in `fqns` fresh optimizer state (zeros of the
// parameter's spec, step 0) so that a loaded checkpoint can fill it, and
// drops the state of the others (they had none when saved: before step 1).
void init_optimizer_state(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                          const std::vector<std::string>& fqns);

// The checks set_optimizer_state_dict makes of a checkpoint's metadata (the
// optimizer's kind, its param groups present and as many), for load_state to
// make before anything changes.
void check_optimizer_metadata(torch::optim::Optimizer& optimizer, const std::map<std::string, std::string>& metadata);

// After `sd` (from get_optimizer_state_dict on this optimizer) was loaded:
// copies the loaded step counts into the optimizer's state and restores the
// param groups' options (lr, betas, momentum...) from sd.metadata.
void set_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer, const StateDict& sd);

}  // namespace dtp::dcp
