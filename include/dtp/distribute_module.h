// distribute_module: PyTorch's torch.distributed.tensor.distribute_module.
#pragma once

#include "dtp/device_mesh.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}

namespace dtp {

// Called for every submodule (the root as ""); converts its parameters with
// dtp::set_parameter(module, name, distribute_tensor(...)).
using PartitionFn =
    std::function<void(const std::string& fqn, torch::nn::Module& module, const DeviceMesh& mesh)>;
// Rewrite the root's forward tensor arguments / output (e.g. from_local).
using InputFn = std::function<void(std::vector<at::Tensor>& inputs, const DeviceMesh& mesh)>;
using OutputFn = std::function<void(at::Tensor& output, const DeviceMesh& mesh)>;

// Runs partition_fn on every submodule, then replicates every parameter it
// left plain (all of them without a partition_fn). input_fn and output_fn
// become hooks on the root, which must then be a dtp::nn::Hooked module.
void distribute_module(torch::nn::Module& module, const DeviceMesh& mesh,
                       PartitionFn partition_fn = nullptr, InputFn input_fn = nullptr,
                       OutputFn output_fn = nullptr);

}  // namespace dtp
