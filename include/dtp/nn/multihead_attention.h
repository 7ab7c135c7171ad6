// torch::nn::MultiheadAttention with tensor-parallel heads. Until
// parallelized it *is* the stock module (options, fields, forward).
// PairwiseParallel on it (the 2023 API) calls shard_heads: each rank then
// owns num_heads/tp whole heads, as in Megatron-LM:
//   in_proj_weight  [3E, E] -> [3, E, E] S(1)  (q/k/v stacked; rows per head)
//   in_proj_bias    [3E]    -> [3, E]    S(1)
//   q/k/v_proj_weight (kdim/vdim != E)  S(0)
//   out_proj.weight S(1), out_proj.bias R
// (full_tensor(in_proj_weight).flatten(0, 1) is the original packed weight.)
// Forward: inputs are replicated (plain tensors count as the full tensor),
// attention runs on local heads, out_proj all-reduces once; the output and
// the attention weights come back as plain, replicated tensors. Dropout on
// the attention weights equals a single device's for the same seed.
#pragma once

#include "dtp/device_mesh.h"
#include "dtp/nn/hooked.h"

#include <torch/nn/modules/activation.h>

#include <optional>
#include <string>
#include <tuple>

namespace dtp::nn {

class MultiheadAttentionImpl : public torch::nn::MultiheadAttentionImpl {
 public:
  using torch::nn::MultiheadAttentionImpl::MultiheadAttentionImpl;

  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& query, const at::Tensor& key,
                                             const at::Tensor& value,
                                             const at::Tensor& key_padding_mask = {},
                                             bool need_weights = true,
                                             const at::Tensor& attn_mask = {},
                                             bool average_attn_weights = true);

  // Splits the heads over the 1-D `mesh` (parameters become DTensors). `fqn`
  // names the module in errors.
  void shard_heads(const DeviceMesh& mesh, std::optional<int> src_data_rank, const std::string& fqn);

 private:
  at::Tensor projectLocal(const at::Tensor& x, int64_t which);
  DeviceMesh mesh_;
};
DTP_MODULE(MultiheadAttention);

}  // namespace dtp::nn
