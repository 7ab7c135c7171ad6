// Fused attention (libtorch 2.x, DTP_HAS_SDPA): at::scaled_dot_product_attention
// decomposes above DTensor into its CPU flash kernel and that kernel's
// backward, whose rules are here. Attention is independent per batch entry
// and per head, so q, k, v [B, H, L, E] (and the output, logsumexp [B, H, L]
// and the gradients) are sharded together on the batch dim or the head dim,
// or all replicated. A mask broadcast along the sharded dim stays replicated;
// one with that dim in full is sharded with the others. The sequence dims
// never shard here: a causal mask would need each shard's offset.
#include "comm/compat.h"
#include "dtensor/rules/common.h"

#include <ATen/OpMathType.h>

namespace dtp {
namespace {

using rules::replicate_row;

#if DTP_HAS_SDPA

// Rows where every slot but the mask is a [B, H, ...] attention tensor and
// shards with the others; the mask (the argument named attn_mask, if a
// DTensor) shards along when it has that dim in full.
std::vector<Row> attentionRows(const OpCall& call, int64_t) {
  std::vector<Row> rows{replicate_row(call)};
  int mask = -1;
  const auto& args = call.op.schema().arguments();
  for (size_t i = 0; i < args.size(); ++i)
    if (args[i].name() == "attn_mask") mask = call.slot_of_arg(static_cast<int>(i));
  for (int64_t dim : {0, 1}) {  // batch, heads
    Row row;
    for (size_t s = 0; s < call.specs.size(); ++s) {
      if (static_cast<int>(s) != mask) {
        row.in.push_back(Shard(dim));
        continue;
      }
      // The mask broadcasts to [B, H, L, S] from its trailing dims.
      const auto& shape = call.spec(s).shape;
      const int64_t at = dim - (4 - static_cast<int64_t>(shape.size()));
      row.in.push_back(at >= 0 && shape[at] > 1 ? Shard(at) : Replicate());
    }
    row.out.assign(call.num_outputs, Shard(dim));
    rows.push_back(std::move(row));
  }
  return rows;
}

// The kernels have no Meta kernel: output [B, H, L, Ev] in q's dtype and
// logsumexp [B, H, L] in its accumulation type.
OutputMeta flashShape(const OpCall& call) {
  const DTensorSpec &q = call.spec(0), &v = call.spec(2);
  return OutputMeta{{{q.shape[0], q.shape[1], q.shape[2], v.shape[3]}, {q.shape[0], q.shape[1], q.shape[2]}},
                    {q.dtype, at::toOpMathType(q.dtype)}};
}

// Gradients of q, k, v (slots 1, 2, 3 after grad_out), shaped like them.
OutputMeta flashBackwardShape(const OpCall& call) {
  OutputMeta m;
  for (size_t s : {1, 2, 3}) {
    m.shapes.push_back(call.spec(s).shape);
    m.dtypes.push_back(call.spec(s).dtype);
  }
  return m;
}

#endif

}  // namespace

void registerAttentionRules(RuleRegistry& r) {
#if DTP_HAS_SDPA
  r.add("aten::_scaled_dot_product_flash_attention_for_cpu", attentionRows, flashShape);
  r.add("aten::_scaled_dot_product_flash_attention_for_cpu_backward", attentionRows, flashBackwardShape);
#else
  (void)r;
#endif
}

}  // namespace dtp
