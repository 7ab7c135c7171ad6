// dtp::optim::AdamW: torch::optim::AdamW whose step runs on the local shards
// of DTensor parameters.
//
//   dtp::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
//
// libtorch's AdamW makes about 9 tensor ops per parameter and step; on a
// DTensor each is a DTensor dispatch around the local op (PyTorch amortises
// this with foreach kernels, which libtorch's C++ optimizers lack). This step
// hands libtorch's own AdamW::step aliases of the parameters' shards, so the
// arithmetic is libtorch's, bit for bit, at the cost of plain ops. A
// parameter qualifies when its gradient and its AdamW state are DTensors with
// its own spec (keep_grad_placements sees to the gradient); any other takes
// the ordinary path, DTensor dispatch included. The state stays DTensors
// keyed by the parameters, so state(), save/load and dtp checkpoints see
// exactly what torch::optim::AdamW holds, and the parameters' version
// counters move as with in-place ops on them (autograd still catches a stale
// graph).
#pragma once

#include <torch/optim/adamw.h>

namespace dtp::optim {

class AdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace dtp::optim
