// visualize_sharding: which rank holds which block of a DTensor, as
// torch.distributed.tensor.debug.visualize_sharding shows it.
//
//   std::cout << dtp::visualize_sharding(t);   // on one rank: the text is the same on all
//
//   f32[5,4] (S(0)R) on DeviceMesh((dp=2, tp=2), cpu)
//   | block | ranks (dp, tp) |
//   |---|---|
//   | [0:3, 0:4] | 0 (0, 0), 1 (0, 1) |
//   | [3:5, 0:4] | 2 (1, 0), 3 (1, 1) |
//   dp: S(0) splits dim 0 in 2
//   tp: R, the ranks of a row differing only in tp hold equal copies
//
// Any tensor rank and mesh rank; uneven and empty shards (a block "[3:3]" is
// empty) and Partial (a pending reduction: the ranks of a row hold parts of
// the block's value) included. Computed from the spec alone: no collective.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace dtp {

std::string visualize_sharding(const at::Tensor& dtensor);

}  // namespace dtp
