// SpecFacts: what the op that made a DTensor knew of its shard, carried in
// the DTensor's spec instead of a side table matched by tensor identity.
#pragma once

#include "dtp/dtensor_spec.h"

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace dtp {

// NOTE: [Facts in specs]
// Some facts about a tensor are data, not placements: which positions of a
// MaskPartial tensor are this rank's (NOTE: [MaskPartial]), or the sums of a
// gradient along a dim that its maker knew without communication
// (loss_parallel's nll_loss gradient, whose row sums are -weight[target] *
// grad_out on every rank). They ride in DTensorSpec::facts, so they live
// exactly as long as a tensor (or an autograd node's saved spec) holds them,
// and reach whoever receives the tensor: no table keyed by tensor identity.
// Specs compare and hash without them (a decision cached for one
// MaskPartial tensor serves the next; its plan runs with the live spec's
// mask). The dispatcher hands them from a view op's input to its output
// (NOTE: [Dispatch]); a reader checks that a fact fits the tensor it reads
// it from (dim_sums: the dims around `sum_dim` still multiply to the same),
// and computes without it when it does not.
struct SpecFacts {
  // MaskPartial: true where the value is another rank's (as PyTorch's
  // MaskBuffer), shaped like the tensor's leading dims (the lookup's
  // indices) or like the tensor. Undefined: nothing to mask (the shard is
  // already a plain partial sum).
  at::Tensor mask;
  // The global tensor's sums along `sum_dim` (keepdim, this rank's shard of
  // the other dims), known on every rank. Undefined when not known.
  at::Tensor dim_sums;
  int64_t sum_dim = -1;
  // Local sizes when made: the dims before and after sum_dim multiply to
  // these (a reader's check that a view kept them).
  int64_t rows_before = 0, rows_after = 0;
  // The shard's version counter when made: an in-place change since (a
  // gradient hook's) makes dim_sums stale.
  int64_t version = -1;
};

// `spec` with `facts` attached (a copy: specs are shared and immutable).
inline std::shared_ptr<const DTensorSpec> with_facts(const std::shared_ptr<const DTensorSpec>& spec,
                                                      std::shared_ptr<const SpecFacts> facts) {
  auto s = std::make_shared<DTensorSpec>(*spec);
  s->facts = std::move(facts);
  return s;
}

}  // namespace dtp
