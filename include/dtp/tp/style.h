// ParallelStyles: how parallelize_module changes one module. Value types with
// PyTorch's defaults; options in libtorch's TORCH_ARG style:
//   dtp::RowwiseParallel(dtp::RowwiseParallelOptions().output_layouts(dtp::Shard(1)))
#pragma once

#include "dtp/device_mesh.h"
#include "dtp/placement.h"

#include <torch/arg.h>

#include <initializer_list>
#include <map>
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

// What every style shares, written once (CRTP): its options, held by value
// with PyTorch's defaults, and its name, Derived::kName.
template <class Derived, class Options>
class ParallelStyleWith : public ParallelStyle {
 public:
  explicit ParallelStyleWith(Options options = {}) : options_(std::move(options)) {}
  std::string name() const override { return Derived::kName; }
  const Options& options() const { return options_; }

 protected:
  Options options_;
};

struct ColwiseParallelOptions {
  TORCH_ARG(Placement, input_layouts) = Replicate();
  TORCH_ARG(Placement, output_layouts) = Shard(-1);
  TORCH_ARG(bool, use_local_output) = true;
};

// nn::Linear: weight and bias Shard(0), output sharded on the last dim.
// nn::Embedding: weight Shard(1) (embedding dim).
class ColwiseParallel : public ParallelStyleWith<ColwiseParallel, ColwiseParallelOptions> {
 public:
  static constexpr const char* kName = "ColwiseParallel";
  using ParallelStyleWith::ParallelStyleWith;
  void apply(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
             std::optional<int> src_data_rank) const override;
};

struct RowwiseParallelOptions {
  TORCH_ARG(Placement, input_layouts) = Shard(-1);
  TORCH_ARG(Placement, output_layouts) = Replicate();
  TORCH_ARG(bool, use_local_output) = true;
};

// nn::Linear: weight Shard(1), bias Replicate; the Partial output becomes
// output_layouts (Replicate: all_reduce; Shard(d): reduce_scatter).
// nn::Embedding: weight Shard(0) (vocab); replicated ids; Partial output.
class RowwiseParallel : public ParallelStyleWith<RowwiseParallel, RowwiseParallelOptions> {
 public:
  static constexpr const char* kName = "RowwiseParallel";
  using ParallelStyleWith::ParallelStyleWith;
  void apply(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
             std::optional<int> src_data_rank) const override;
};

struct SequenceParallelOptions {
  TORCH_ARG(int64_t, sequence_dim) = 1;
  TORCH_ARG(bool, use_local_output) = false;
};

// Norms and dropout on sequence-sharded activations: parameters replicated;
// forward's first argument becomes Shard(sequence_dim): a plain tensor is
// taken as this rank's shard, a DTensor in another layout is redistributed
// (Replicate -> S(d): a local chunk; backward all-gathers its gradient).
class SequenceParallel : public ParallelStyleWith<SequenceParallel, SequenceParallelOptions> {
 public:
  static constexpr const char* kName = "SequenceParallel";
  using ParallelStyleWith::ParallelStyleWith;
  void apply(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
             std::optional<int> src_data_rank) const override;
};

// Layouts of a forward's arguments or outputs, one entry each, in order;
// nullopt leaves one alone (PyTorch's None placeholder). A single Placement
// is a one-entry list, as in PyTorch:
//   .input_layouts({Shard(1), std::nullopt})    .output_layouts(Replicate())
struct Layouts : std::vector<std::optional<Placement>> {
  Layouts() = default;
  Layouts(Placement p) : std::vector<std::optional<Placement>>{p} {}  // NOLINT: implicit, as PyTorch's
  Layouts(std::initializer_list<std::optional<Placement>> l) : std::vector<std::optional<Placement>>(l) {}
};

// Layouts of forward arguments by name (PyTorch's input_kwarg_layouts). C++
// has no keyword arguments: a module names its forward's arguments once with
// DTP_FORWARD_ARGS (nn/hooked.h), and these keys are those names.
using KwargLayouts = std::map<std::string, Placement>;

// NOTE: [Argument positions] input_layouts counts every argument of forward,
// as PyTorch counts every positional argument: a non-tensor argument takes
// nullopt (a layout given for one is an error), an absent
// std::optional<at::Tensor> or undefined tensor is left alone. It has one
// entry per argument of the call, or fewer when the rest are keyword
// arguments: the module names its arguments and input_kwarg_layouts keys
// them (arguments after input_layouts that it does not key pass through, as
// PyTorch's unlisted kwargs do). Empty input_layouts (PyTorch's None) leaves
// the positional arguments alone.
struct PrepareModuleInputOptions {
  TORCH_ARG(Layouts, input_layouts);
  TORCH_ARG(Layouts, desired_input_layouts);
  TORCH_ARG(KwargLayouts, input_kwarg_layouts);
  TORCH_ARG(KwargLayouts, desired_input_kwarg_layouts);
  TORCH_ARG(bool, use_local_output) = false;
  // Megatron's f: redistribute even where the input already has the desired
  // layout, so that the gradients of everything inside the module meet here
  // and are reduced to the input's layout (for a Replicate input: one
  // all-reduce of the sum of its Colwise projections' Partial gradients, so
  // the layer before gets a Replicate gradient). dtp extension.
  TORCH_ARG(bool, gradient_boundary) = false;
};

// Turns forward's arguments into DTensors with input_layouts (plain tensors
// are this rank's shard) and redistributes them to the desired ones. See
// NOTE: [Argument positions].
class PrepareModuleInput : public ParallelStyleWith<PrepareModuleInput, PrepareModuleInputOptions> {
 public:
  static constexpr const char* kName = "PrepareModuleInput";
  using ParallelStyleWith::ParallelStyleWith;
  void apply(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
             std::optional<int> src_data_rank) const override;
};

// output_layouts and desired_output_layouts are required (PyTorch has no
// default): one entry per output of forward (NOTE: [Forward slots] in
// nn/hooked.h: a std::tuple or std::vector<at::Tensor> has several), nullopt
// for one to leave alone.
struct PrepareModuleOutputOptions {
  TORCH_ARG(Layouts, output_layouts);
  TORCH_ARG(Layouts, desired_output_layouts);
  TORCH_ARG(bool, use_local_output) = true;
};

class PrepareModuleOutput : public ParallelStyleWith<PrepareModuleOutput, PrepareModuleOutputOptions> {
 public:
  static constexpr const char* kName = "PrepareModuleOutput";
  using ParallelStyleWith::ParallelStyleWith;
  void apply(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
             std::optional<int> src_data_rank) const override;
};

// PyTorch's PrepareModuleInputOutput keywords in one struct.
struct PrepareModuleInputOutputOptions {
  TORCH_ARG(Layouts, input_layouts);
  TORCH_ARG(Layouts, desired_input_layouts);
  TORCH_ARG(KwargLayouts, input_kwarg_layouts);
  TORCH_ARG(KwargLayouts, desired_input_kwarg_layouts);
  TORCH_ARG(bool, use_local_input) = false;
  TORCH_ARG(Layouts, output_layouts);
  TORCH_ARG(Layouts, desired_output_layouts);
  TORCH_ARG(bool, use_local_output) = true;
};

class PrepareModuleInputOutput : public ParallelStyle {
 public:
  PrepareModuleInputOutput(PrepareModuleInputOptions in, PrepareModuleOutputOptions out)
      : in_(std::move(in)), out_(std::move(out)) {}
  explicit PrepareModuleInputOutput(const PrepareModuleInputOutputOptions& o);
  void apply(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
             std::optional<int> src_data_rank) const override;
  std::string name() const override { return "PrepareModuleInputOutput"; }

 private:
  PrepareModuleInput in_;
  PrepareModuleOutput out_;
};

}  // namespace dtp
