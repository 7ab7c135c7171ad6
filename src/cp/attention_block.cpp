#include "cp/attention_block.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

namespace dtp::cp {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// lse with -inf (a query that saw no key) as 0, so that exp(s - lse) is 0
// for its hidden scores instead of NaN.
at::Tensor finite(const at::Tensor& lse) { return lse.masked_fill(lse == -kInf, 0); }

}  // namespace

at::ScalarType accumulationType(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 ? at::kFloat : t;
}

AttentionShape checkAttention(const char* api, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const ProcessGroup& group, const CpAttentionOptions& options) {
  TORCH_CHECK(q.defined() && k.defined() && v.defined(), api, ": q, k and v must be defined tensors.");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, api,
              ": expected q, k and v shaped [B, H, S_local, D], got q ", q.sizes(), ", k ", k.sizes(), ", v ",
              v.sizes(), ".");
  TORCH_CHECK(at::isFloatingType(q.scalar_type()) && k.scalar_type() == q.scalar_type() &&
                  v.scalar_type() == q.scalar_type(),
              api, ": expected q, k and v of one floating dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type(), ".");
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(), api, ": q, k and v are on ", q.device(), ", ",
              k.device(), ", ", v.device(), "; expected one device.");
  AttentionShape s;
  s.batch = q.size(0), s.heads = q.size(1), s.local_len = q.size(2), s.head_dim = q.size(3);
  s.kv_heads = k.size(1), s.v_dim = v.size(3);
  TORCH_CHECK(k.size(0) == s.batch && v.size(0) == s.batch && v.size(1) == s.kv_heads && v.size(2) == k.size(2),
              api, ": k ", k.sizes(), " and v ", v.sizes(), " do not match q ", q.sizes(),
              " (expected one batch size, and k and v with one head count and length).");
  TORCH_CHECK(k.size(2) == s.local_len, api, ": q holds ", s.local_len, " local positions but k and v ", k.size(2),
              ". Shard q, k and v of one sequence with one layout (self-attention).");
  TORCH_CHECK(k.size(3) == s.head_dim, api, ": q's head dim is ", s.head_dim, " but k's ", k.size(3), ".");
  TORCH_CHECK(s.kv_heads >= 1 && s.heads % s.kv_heads == 0, api, ": ", s.heads,
              " query heads are not a multiple of ", s.kv_heads, " key/value heads (GQA needs H % H_kv == 0).");
  s.group = s.heads / s.kv_heads;
  s.cp_size = group.size(), s.cp_rank = group.rank();
  s.causal = options.causal(), s.layout = options.layout(), s.window = options.window();
  TORCH_CHECK(s.window >= 0 && (s.window == 0 || s.causal), api, ": got window ", s.window, s.causal ? "" :
              " without causal", ", expected 0 (no sliding window) or a positive window with causal(true): the "
              "window hides keys window or more positions before the query, under the causal mask.");
  TORCH_CHECK(options.seq_len() >= 0, api, ": got seq_len ", options.seq_len(),
              ", expected the global length (or 0: cp * S_local).");
  s.seq_len = options.seq_len() > 0 ? options.seq_len() : s.local_len * s.cp_size;
  if (s.layout == CpLayout::HeadTail)
    TORCH_CHECK(s.seq_len >= 2 * s.cp_size, api, ": the HeadTail layout cuts the sequence into 2*cp = ",
                2 * s.cp_size, " chunks, but seq_len is ", s.seq_len,
                ". Use CpLayout::Contiguous for a sequence this short, or a smaller cp.");
  const int64_t expected = context_parallel_local_len(s.seq_len, s.cp_size, s.cp_rank, s.layout);
  TORCH_CHECK(s.local_len == expected, api, ": cp rank ", s.cp_rank, " holds ", s.local_len, " positions, but the ",
              to_string(s.layout), " layout of seq_len ", s.seq_len, options.seq_len() == 0 ? " (cp * S_local)" : "",
              " over cp ", s.cp_size, " gives it ", expected,
              ". Shard q, k and v with context_parallel_shard(x, 2, group, layout) and pass "
              "CpAttentionOptions::seq_len(S).");
  TORCH_CHECK(!options.scale().has_value() || std::isfinite(*options.scale()), api, ": got scale ",
              *options.scale(), ", expected a finite number.");
  s.scale = options.scale().value_or(1.0 / std::sqrt(static_cast<double>(s.head_dim)));
  return s;
}

ProcessGroup groupOfMesh(const char* api, const DeviceMesh& mesh) {
  TORCH_CHECK(mesh.valid() && mesh.ndim() == 1, api, ": expected a 1-D mesh over the cp ranks, got ",
              mesh.valid() ? mesh.str() : std::string("an invalid mesh"), ". Slice its cp dim: mesh[\"cp\"].");
  return mesh.get_group(0);
}

at::Tensor groupQueryHeads(const at::Tensor& q, int64_t kv_heads) {
  return q.reshape({q.size(0), kv_heads, q.size(1) / kv_heads, q.size(2), q.size(3)});
}

BlockKind blockKind(const SeqSegment& q, const SeqSegment& k, bool causal, int64_t window) {
  if (q.length == 0 || k.length == 0) return BlockKind::Skip;
  if (!causal) return BlockKind::Full;
  const int64_t q_last = q.start + q.length - 1, k_last = k.start + k.length - 1;
  if (k.start > q_last) return BlockKind::Skip;  // every key after every query
  // The window: key j is visible to query i when i - j < window.
  if (window > 0 && q.start - k_last >= window) return BlockKind::Skip;  // every key too far back
  const bool all_before = k_last <= q.start, all_within = window <= 0 || q_last - k.start < window;
  return all_before && all_within ? BlockKind::Full : BlockKind::Masked;
}

at::Tensor causalMask(const at::Tensor& q_positions, const at::Tensor& k_positions, int64_t window) {
  const at::Tensor back = q_positions.unsqueeze(1) - k_positions.unsqueeze(0);  // i - j
  return window > 0 ? back.lt(0).logical_or_(back.ge(window)) : back.lt(0);
}

at::Tensor causalMask(const SeqSegment& q, const SeqSegment& k, c10::Device device, int64_t window) {
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  return causalMask(at::arange(q.start, q.start + q.length, opts), at::arange(k.start, k.start + k.length, opts),
                    window);
}

Block blockForward(const at::Tensor& q5, const at::Tensor& k5, const at::Tensor& v5, double scale,
                   const at::Tensor& hidden) {
  at::Tensor s = at::matmul(q5, k5.transpose(-1, -2)).to(accumulationType(q5.scalar_type())).mul_(scale);
  if (hidden.defined()) s.masked_fill_(hidden, -kInf);
  at::Tensor lse = s.logsumexp(-1);
  at::Tensor p = s.sub_(finite(lse).unsqueeze(-1)).exp_();
  return {at::matmul(p.to(v5.scalar_type()), v5), lse};
}

void mergeBlock(at::Tensor& out, at::Tensor& lse, const Block& b) {
  at::Tensor merged = at::logaddexp(lse, b.lse);
  const at::Tensor m = finite(merged);
  out = out * (lse - m).exp_().unsqueeze(-1) + b.out * (b.lse - m).exp_().unsqueeze(-1);
  lse = std::move(merged);
}

void blockBackward(const at::Tensor& q5, const at::Tensor& k5, const at::Tensor& v5, const at::Tensor& dout5,
                   const at::Tensor& lse, const at::Tensor& delta, double scale, const at::Tensor& hidden,
                   at::Tensor dq5, at::Tensor dk5, at::Tensor dv5) {
  const at::ScalarType in = q5.scalar_type(), acc = accumulationType(in);
  at::Tensor s = at::matmul(q5, k5.transpose(-1, -2)).to(acc).mul_(scale);
  if (hidden.defined()) s.masked_fill_(hidden, -kInf);
  const at::Tensor p = s.sub_(finite(lse).unsqueeze(-1)).exp_();  // the final softmax's entries of this block
  dv5.add_(at::matmul(p.to(in).transpose(-1, -2), dout5).sum(2, /*keepdim=*/true));
  at::Tensor ds = at::matmul(dout5, v5.transpose(-1, -2)).to(acc).sub_(delta.unsqueeze(-1)).mul_(p).to(in);
  dq5.add_(at::matmul(ds, k5), scale);
  dk5.add_(at::matmul(ds.transpose(-1, -2), q5).sum(2, /*keepdim=*/true), scale);
}

}  // namespace dtp::cp
