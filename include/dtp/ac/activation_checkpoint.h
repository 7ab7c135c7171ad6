// Activation checkpointing: torch.utils.checkpoint and checkpoint_wrapper
// for libtorch, with DTensors and the styles' hooks.
//
//   at::Tensor y = dtp::checkpoint([&](const std::vector<at::Tensor>& in) { return block(in[0]); }, {x})[0];
//   dtp::checkpoint_wrapper(*block);               // every call of block is checkpointed
//   dtp::models::apply_ac(model, {ACMode::Full});  // torchtitan's apply_ac
//
// The forward runs without keeping activations; backward runs it again with
// the random state it had (so dropout masks, DTensor ones included, are the
// first pass's) and back-propagates through the recomputation. In Full mode
// the recomputation repeats the forward's collectives; in Selective mode
// the outputs of matrix products and of every collective are kept from the
// first pass, so the recomputation communicates nothing and multiplies no
// matrices. Which DTensor ops selective mode keeps is data, a save list as
// torchtitan's op_sac_save_list: the matrix products by default. See
// NOTE: [Checkpoint] in src/ac/activation_checkpoint.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <string>
#include <vector>

namespace dtp {

enum class ACMode : uint8_t { Full, Selective };

using CheckpointFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;

// fn(inputs) without keeping its activations; differentiable with respect to
// `inputs` and to every parameter fn uses. fn must be deterministic given its
// inputs and the random state (it runs twice) and must not change `inputs`
// in place; inputs changed in place after the call are an error in backward.
// The DTensor ops whose outputs selective mode keeps (besides every
// collective's): aten::mm, aten::addmm, aten::bmm, aten::baddbmm. An op of
// one output that writes nothing can be listed, by its schema's name.
std::vector<std::string> default_sac_save_ops();

std::vector<at::Tensor> checkpoint(const CheckpointFn& fn, const std::vector<at::Tensor>& inputs,
                                   ACMode mode = ACMode::Full,
                                   const std::vector<std::string>& save_ops = default_sac_save_ops());

// Checkpoints every call of `module` (its hooks included). The module must
// run hooks (a DTP_MODULE or a dtp::nn module) and its forward return one
// tensor.
void checkpoint_wrapper(torch::nn::Module& module, ACMode mode = ACMode::Full,
                        std::vector<std::string> save_ops = default_sac_save_ops());

// True while a checkpointed function runs again in backward.
bool in_checkpoint_recompute();

}  // namespace dtp
