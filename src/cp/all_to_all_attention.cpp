// All-to-all attention (DeepSpeed's Ulysses): the sequence-sharded q, k and v
// become head-sharded for a whole-sequence attention, and the output goes back.
#include "cp/attention_block.h"
#include "cp/layout.h"
#include "dtp/cp/context_parallel.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>

#include <limits>

namespace dtp {
namespace cp {
namespace {

struct GroupHolder : torch::CustomClassHolder {
  explicit GroupHolder(ProcessGroup g) : group(std::move(g)) {}
  ProcessGroup group;
};

// ProcessGroup::all_to_all with autograd: the gradient goes back the way
// the pieces came (the same collective with split and cat swapped).
struct AllToAll : public torch::autograd::Function<AllToAll> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t split_dim,
                            std::vector<int64_t> split_sizes, int64_t cat_dim, std::vector<int64_t> cat_sizes,
                            ProcessGroup group) {
    ctx->saved_data["split_dim"] = split_dim;
    ctx->saved_data["cat_dim"] = cat_dim;
    ctx->saved_data["split"] = c10::List<int64_t>(split_sizes);
    ctx->saved_data["cat"] = c10::List<int64_t>(cat_sizes);
    ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupHolder>(group));
    return group.all_to_all(x.contiguous(), split_dim, split_sizes, cat_dim, cat_sizes).wait();
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const ProcessGroup group =
        c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data["group"].toCapsule())->group;
    at::Tensor g = group.all_to_all(grads[0].contiguous(), ctx->saved_data["cat_dim"].toInt(),
                                    ctx->saved_data["cat"].toIntVector(), ctx->saved_data["split_dim"].toInt(),
                                    ctx->saved_data["split"].toIntVector())
                       .wait();
    return {g, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// [B, H, S_local, D] sequence-sharded -> [B, H / cp, S, D] head-sharded, the
// sequence in rank order (each rank's segments, rank after rank).
at::Tensor toHeads(const at::Tensor& x, const std::vector<int64_t>& lens, const ProcessGroup& group) {
  const int64_t n = group.size();
  return AllToAll::apply(x, /*split_dim=*/1, std::vector<int64_t>(n, x.size(1) / n), /*cat_dim=*/2, lens, group);
}

}  // namespace
}  // namespace cp

// The sequence after the all_to_all is in rank order, not position order:
// attention does not care for the keys' order, and the causal mask is built
// from the positions the layout gives, so nothing is permuted.
at::Tensor all_to_all_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const ProcessGroup& group, const CpAttentionOptions& options) {
  const char* api = "all_to_all_attention";
  const cp::AttentionShape s = cp::checkAttention(api, q, k, v, group, options);
  const int64_t n = s.cp_size;
  TORCH_CHECK(s.heads % n == 0, api, ": ", s.heads, " query heads do not divide over cp ", n,
              " (each rank attends with H / cp of them). Use a cp that divides ", s.heads, ", or ring_attention.");
  at::Tensor kk = k, vv = v;
  int64_t kv_heads = s.kv_heads;
  if (kv_heads % n != 0) {
    // Fewer key/value heads than the split needs: give each query head its
    // own (repeat_interleave, as enable_gqa reads them); their gradients sum
    // back through the repeat.
    kk = k.repeat_interleave(s.group, 1);
    vv = v.repeat_interleave(s.group, 1);
    kv_heads = s.heads;
  }
  const std::vector<int64_t> lens = cp::localLens(s.seq_len, n, s.layout);
  const at::Tensor qh = cp::toHeads(q, lens, group), kh = cp::toHeads(kk, lens, group),
                   vh = cp::toHeads(vv, lens, group);
  // Rank p now has query heads [p*H/cp, (p+1)*H/cp) and key/value heads
  // [p*H_kv/cp, ...): query head h still meets key/value head h / (H / H_kv).
  const at::Tensor q5 = cp::groupQueryHeads(qh, kv_heads / n);
  at::Tensor scores = at::matmul(q5, kh.unsqueeze(2).transpose(-1, -2)) * s.scale;
  if (s.causal) {
    std::vector<SeqSegment> order;
    for (const auto p : c10::irange(n))
      for (const auto& seg : context_parallel_segments(s.seq_len, n, p, s.layout)) order.push_back(seg);
    const at::Tensor pos = cp::positionsOf(order, q.device());
    scores = scores.masked_fill(cp::causalMask(pos, pos, s.window), -std::numeric_limits<double>::infinity());
  }
  const at::Tensor o = at::matmul(scores.softmax(-1), vh.unsqueeze(2)).reshape({s.batch, s.heads / n, s.seq_len, s.v_dim});
  return cp::AllToAll::apply(o, /*split_dim=*/2, lens, /*cat_dim=*/1, std::vector<int64_t>(n, s.heads / n), group);
}

at::Tensor all_to_all_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const DeviceMesh& mesh, const CpAttentionOptions& options) {
  return all_to_all_attention(q, k, v, cp::groupOfMesh("all_to_all_attention", mesh), options);
}

}  // namespace dtp
