// ParallelStyles: how parallelize_module changes one module. Value types with
// PyTorch's defaults; options in libtorch's TORCH_ARG style:
//   dtp::RowwiseParallel(dtp::RowwiseParallelOptions().output_layouts(dtp::Shard(1)))
#pragma once

#include "dtp/device_mesh.h"
#include "dtp/placement.h"

#include <torch/arg.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}

namespace dtp {

class ParallelStyle {
 public:
  virtual ~ParallelStyle() = default;
  // Changes `module` (found at `fqn`) for the 1-D `mesh`.
  virtual void apply(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
                     std::optional<int> src_data_rank) const = 0;
  virtual std::string name() const = 0;
};

struct ColwiseParallelOptions {
  TORCH_ARG(Placement, input_layouts) = Replicate();
  TORCH_ARG(Placement, output_layouts) = Shard(-1);
  TORCH_ARG(bool, use_local_output) = true;
};

// nn::Linear: weight and bias Shard(0), output sharded on the last dim.
// nn::Embedding: weight Shard(1) (embedding dim).
class ColwiseParallel : public ParallelStyle {
 public:
  explicit ColwiseParallel(ColwiseParallelOptions options = {}) : options_(options) {}
  void apply(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
             std::optional<int> src_data_rank) const override;
  std::string name() const override { return "ColwiseParallel"; }

 private:
  ColwiseParallelOptions options_;
};

struct RowwiseParallelOptions {
  TORCH_ARG(Placement, input_layouts) = Shard(-1);
  TORCH_ARG(Placement, output_layouts) = Replicate();
  TORCH_ARG(bool, use_local_output) = true;
};

// nn::Linear: weight Shard(1), bias Replicate; the Partial output becomes
// output_layouts (Replicate: all_reduce; Shard(d): reduce_scatter).
// nn::Embedding: weight Shard(0) (vocab); replicated ids; Partial output.
class RowwiseParallel : public ParallelStyle {
 public:
  explicit RowwiseParallel(RowwiseParallelOptions options = {}) : options_(options) {}
  void apply(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
             std::optional<int> src_data_rank) const override;
  std::string name() const override { return "RowwiseParallel"; }

 private:
  RowwiseParallelOptions options_;
};

struct SequenceParallelOptions {
  TORCH_ARG(int64_t, sequence_dim) = 1;
  TORCH_ARG(bool, use_local_output) = false;
};

// Norms and dropout on sequence-sharded activations: parameters replicated,
// input Shard(sequence_dim) (a plain tensor is taken as this rank's shard).
class SequenceParallel : public ParallelStyle {
 public:
  explicit SequenceParallel(SequenceParallelOptions options = {}) : options_(options) {}
  void apply(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
             std::optional<int> src_data_rank) const override;
  std::string name() const override { return "SequenceParallel"; }

 private:
  SequenceParallelOptions options_;
};

// One entry per tensor argument of forward; nullopt leaves that argument alone.
using Layouts = std::vector<std::optional<Placement>>;

struct PrepareModuleInputOptions {
  TORCH_ARG(Layouts, input_layouts);
  TORCH_ARG(Layouts, desired_input_layouts);
  TORCH_ARG(bool, use_local_output) = false;
};

// Turns forward's tensor arguments into DTensors with input_layouts (plain
// tensors are this rank's shard) and redistributes them to the desired ones.
// C++ forwards have no keyword arguments: input_kwarg_layouts has no analogue.
class PrepareModuleInput : public ParallelStyle {
 public:
  explicit PrepareModuleInput(PrepareModuleInputOptions options) : options_(std::move(options)) {}
  void apply(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
             std::optional<int> src_data_rank) const override;
  std::string name() const override { return "PrepareModuleInput"; }

 private:
  PrepareModuleInputOptions options_;
};

struct PrepareModuleOutputOptions {
  TORCH_ARG(Placement, output_layouts);
  TORCH_ARG(Placement, desired_output_layouts);
  TORCH_ARG(bool, use_local_output) = true;
};

class PrepareModuleOutput : public ParallelStyle {
 public:
  explicit PrepareModuleOutput(PrepareModuleOutputOptions options) : options_(options) {}
  void apply(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
             std::optional<int> src_data_rank) const override;
  std::string name() const override { return "PrepareModuleOutput"; }

 private:
  PrepareModuleOutputOptions options_;
};

class PrepareModuleInputOutput : public ParallelStyle {
 public:
  PrepareModuleInputOutput(PrepareModuleInputOptions in, PrepareModuleOutputOptions out)
      : in_(std::move(in)), out_(out) {}
  void apply(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
             std::optional<int> src_data_rank) const override;
  std::string name() const override { return "PrepareModuleInputOutput"; }

 private:
  PrepareModuleInput in_;
  PrepareModuleOutput out_;
};

}  // namespace dtp
