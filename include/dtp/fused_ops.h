// What dtp runs fused on DTensors, and the scope that turns it off.
//
// A bias-free linear, a matmul by a 2-D weight (libtorch's Linear) and
// dtp::nn::rms_norm run on DTensors as one local computation: one DTensor
// op without autograd, one plain graph on the shards under it (NOTE: [Fused
// ops without autograd] and NOTE: [Fused ops under autograd] in
// src/dtensor/fused_ops.cpp), with the values of the decomposition.
#pragma once

namespace dtp {

// Inside this scope those ops run decomposed, each piece a DTensor op. For a
// backward with create_graph=true through them (a gradient penalty): the
// fused graph's gradient is not differentiable again, and its backward says
// so, naming this guard.
class DecomposeFusedOpsGuard {
 public:
  DecomposeFusedOpsGuard();
  ~DecomposeFusedOpsGuard();
  DecomposeFusedOpsGuard(const DecomposeFusedOpsGuard&) = delete;
  DecomposeFusedOpsGuard& operator=(const DecomposeFusedOpsGuard&) = delete;
  static bool enabled();
};

}  // namespace dtp
