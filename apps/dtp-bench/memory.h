// Memory accounting for dtp-bench: live CPU tensor bytes through a counting
// allocator, and the bytes of parameters, gradients and optimizer state, split
// into what is sharded and what is replicated.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <vector>

namespace dtp::bench {

constexpr double kMiB = 1024.0 * 1024.0;  // the tables' unit

// Wraps c10's CPU allocator (call once, first thing in main): every CPU
// allocation after that is counted while it lives.
void install_memory_tracker();
int64_t live_bytes();
// The most live_bytes() reached since reset_peak().
int64_t peak_bytes();
void reset_peak();

struct StateBytes {
  int64_t total = 0, replicated = 0;  // this rank's bytes; replicated: plain or all-Replicate DTensors
  void add(const at::Tensor& t);
};

struct ModelMemory {
  StateBytes params, grads, optimizer;
  int64_t activations = 0;  // live at the end of the forward, beyond the state above
};

// Bytes of `params` (this rank's shards), their gradients and `opt`'s state.
ModelMemory state_memory(const std::vector<at::Tensor>& params, torch::optim::Optimizer& opt);

}  // namespace dtp::bench
