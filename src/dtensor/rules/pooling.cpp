// Pooling over the spatial dims of [N, C, H, W] (or [C, H, W]): each sample
// and each channel pools alone, so a shard of the batch or of the channels
// keeps its place in the outputs (the max's indices too) and in the input
// gradient; a shard of a spatial dim would cut windows and is gathered
// first. max_pool2d reaches max_pool2d_with_indices (and, in backward, its
// _backward); avg_pool2d has its own pair.
#include "dtensor/rules/common.h"

namespace dtp {
namespace {

// Every tensor argument and output on the same placement: R, or a shard of
// the batch dim or the channel dim (of a batched input; the channel dim of
// an unbatched one).
std::vector<Row> perSampleAndChannelRows(const OpCall& call, int64_t) {
  std::vector<Row> rows{rules::replicate_row(call)};
  const int64_t ndim = call.spec(0).ndim();
  for (int64_t d = 0; d + 2 < ndim; ++d)
    rows.push_back(Row{Placements(call.specs.size(), Shard(d)), Placements(call.num_outputs, Shard(d))});
  return rows;
}

}  // namespace

void registerPoolingRules(RuleRegistry& r) {
  for (const char* op : {"aten::max_pool2d_with_indices", "aten::max_pool2d_with_indices_backward",
                         "aten::avg_pool2d", "aten::avg_pool2d_backward"})
    r.add(op, perSampleAndChannelRows);
}

}  // namespace dtp
