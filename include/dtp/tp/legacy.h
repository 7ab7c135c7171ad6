// The 2023 tensor-parallel API from PyTorch's older documentation, as thin
// layers over the current one: PairwiseParallel and the make_input_* /
// make_output_* helpers (for PrepareModule* style hooks or direct use). A
// plain tensor passed to a make_input_* helper is this rank's part.
#pragma once

#include "dtp/tp/style.h"

#include <ATen/core/Tensor.h>

namespace dtp {

// PyTorch 2.0's PairwiseParallel: on a dtp::nn::MultiheadAttention it splits
// the heads (nn/multihead_attention.h); on a module with two or more direct
// nn::Linear children (an MLP) it pairs them in registration order, Colwise
// then Rowwise; on any other module it looks into each child, at any depth
// (NOTE: [PairwiseParallel's search]). Input and output are replicated; a
// module where it finds nothing is an error (PyTorch does nothing).
class PairwiseParallel : public ParallelStyle {
 public:
  PairwiseParallel() = default;
  void apply(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
             std::optional<int> src_data_rank) const override;
  std::string name() const override { return "PairwiseParallel"; }
  // The first Colwise's input layout and the last Rowwise's output layout.
  Placement input_layout() const { return input_; }
  Placement output_layout() const { return output_; }

 protected:
  PairwiseParallel(Placement input, Placement output) : input_(input), output_(output) {}

 private:
  Placement input_ = Replicate(), output_ = Replicate();
};

namespace legacy {

// PyTorch 2.0's SequenceParallel (not today's, dtp::SequenceParallel):
// PairwiseParallel whose input and output are sharded on dim 0, the sequence
// of a [seq, batch, hidden] activation. The first Colwise all-gathers the
// input (make_input_reshard_replicate), the last Rowwise reduce-scatters its
// output and returns the local shard (make_output_reshard_tensor).
class SequenceParallel : public PairwiseParallel {
 public:
  SequenceParallel();
  std::string name() const override { return "legacy::SequenceParallel"; }
};

}  // namespace legacy

at::Tensor make_input_replicate_1d(const at::Tensor& input, const DeviceMesh& mesh);
at::Tensor make_input_shard_1d(const at::Tensor& input, const DeviceMesh& mesh, int64_t dim = 0);
at::Tensor make_input_shard_1d_last_dim(const at::Tensor& input, const DeviceMesh& mesh);
// A local shard of dim 0 gathered to Replicate.
at::Tensor make_input_reshard_replicate(const at::Tensor& input, const DeviceMesh& mesh);
at::Tensor make_output_replicate_1d(const at::Tensor& output, const DeviceMesh& mesh);
at::Tensor make_output_shard_1d(const at::Tensor& output, const DeviceMesh& mesh, int64_t dim = 0);
// Replicated, as a plain tensor.
at::Tensor make_output_tensor(const at::Tensor& output, const DeviceMesh& mesh);
// Sharded on dim 0, as this rank's plain tensor.
at::Tensor make_output_reshard_tensor(const at::Tensor& output, const DeviceMesh& mesh);

// PyTorch 2.0's enable_2d_with_fsdp() let FSDP take the DTensor parameters
// TP leaves, returning whether it could. dtp's fully_shard composes with TP by
// construction (see fsdp/fully_shard.h): this returns true, so that
// 2023-era code ports unchanged.
bool enable_2d_with_fsdp();

}  // namespace dtp
