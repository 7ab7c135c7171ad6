// What hf_load.cpp and hf_save.cpp share: the Llama's tensors under their HF
// names, and the row runs of NOTE: [Rotary layouts].
#pragma once

#include "dtp/models/hf_llama.h"

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace dtp::models {

struct HFTensor {
  std::string fqn, hf;
  at::Tensor param;
  int64_t rope_head_dim = 0;  // > 0: rows permuted per NOTE: [Rotary layouts]
  // >= 0: the HF tensor is param[expert], one expert of a stacked MoE
  // weight (HF keeps one tensor per expert).
  int64_t expert = -1;
};

// The HF shape of `t`: its parameter's (global) shape, without the expert
// dimension for one expert of a stacked weight.
std::vector<int64_t> hf_shape(const HFTensor& t);

// The model's parameters in save_pretrained's order, each once.
std::vector<HFTensor> hf_tensors(Llama& model);

// A run of rows of a shard and the HF rows they hold: the shard's rows
// local_first, local_first + step, ... (count of them) are HF rows
// hf_first, hf_first + 1, ...
struct RowRun {
  int64_t local_first, step, count, hf_first;
};

// The runs covering the rows [offset, offset + rows) of a tensor (global row
// numbers), for a plain tensor (one run) or a rope-permuted one.
std::vector<RowRun> row_runs(int64_t offset, int64_t rows, int64_t rope_head_dim);

// The rows of `local` a run covers (a strided view).
at::Tensor run_rows(const at::Tensor& local, const RowRun& run);

}  // namespace dtp::models
