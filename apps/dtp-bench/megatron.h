// The baseline dtp-bench compares DTensor TP against: the reference Llama
// with hand-written Megatron-LM tensor parallelism in plain libtorch. Weights
// are sliced by hand, collectives are explicit autograd functions over dtp's
// ProcessGroup (the same Gloo transport DTensor uses), no DTensor anywhere.
// It computes exactly what apply_tensor_parallel's model computes, so both
// report the same loss.
#pragma once

#include "dtp/models/llama.h"
#include "dtp/process_group.h"

#include <ATen/core/Tensor.h>

#include <vector>

namespace dtp::bench {

class MegatronLlama {
 public:
  // This rank's slices of `full` (an unparallelized Llama): q/k/v, w1/w3,
  // embedding and head by rows, wo and w2 by columns, norms whole.
  MegatronLlama(const models::Llama& full, const ProcessGroup& group, bool sequence_parallel);

  // Mean cross-entropy of next-token prediction; vocab-parallel, 3
  // all-reduces forward, none backward.
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets);
  // Under SP each rank's norm weights get a partial gradient: one coalesced
  // all-reduce of all of them (Megatron's allreduce_layernorm_grads). Call
  // after backward.
  void reduce_norm_grads();

  std::vector<at::Tensor> parameters() const;

 private:
  struct Layer {
    at::Tensor attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3;
  };
  at::Tensor enterParallel(const at::Tensor& x);  // replicated or seq-sharded -> replicated
  at::Tensor leaveParallel(const at::Tensor& x);  // partial -> replicated or seq-sharded

  ProcessGroup group_;
  bool sp_;
  models::LlamaConfig config_;
  at::Tensor embedding_, norm_, output_, rope_cos_, rope_sin_;
  int64_t vocab_start_ = 0;
  std::vector<Layer> layers_;
};

}  // namespace dtp::bench
