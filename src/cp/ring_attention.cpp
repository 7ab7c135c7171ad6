// Ring attention: exact attention over a sequence sharded across a cp group,
// the key/value chunks passed around the ring.
#include "cp/attention_block.h"
#include "cp/layout.h"
#include "dtp/cp/context_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>

#include <limits>

namespace dtp {
namespace cp {
namespace {

// NOTE: [Ring attention]
// Each cp rank r keeps its queries (the positions the layout gives it) and,
// over cp rounds, sees every rank's key/value chunk: in round i it holds
// the chunk of rank (r - i) mod cp, starts sending it to r+1, attends its
// queries to it, and receives the next one from r-1 (cp - 1 send/recv pairs
// per rank; k and v travel as one message). Each (query segment, key
// segment) pair is a block (a layout's segments: NOTE: [Head-tail chunk
// lengths] in layout.cpp): skipped when the causal mask (with a sliding
// window, CpAttentionOptions::window, the window too) hides all of it,
// masked on the diagonal and the window's edge, dense otherwise. The chunks
// still travel the whole ring: cp - 1 pairs whatever the window. A block gives its output
// normalised over its own keys, O_b, and the log-sum-exp of its scores,
// lse_b; two blocks of the same queries merge exactly as one softmax:
//   lse = log(exp(lse_1) + exp(lse_2)),  O = O_1 exp(lse_1 - lse) + O_2 exp(lse_2 - lse)
// (logaddexp; a query that saw no key yet has lse -inf and weight 0).
//   Under HeadTail, rank r holds chunks r and 2cp-1-r; against rank s < r's
// chunks it attends both query chunks to chunk s and skips chunk 2cp-1-s,
// against s > r only its tail chunk attends, to both: 2cp + 1 blocks of
// c x c per rank (2 of them diagonal), whatever r. Under Contiguous, rank r
// computes r + 1 blocks: the last rank does cp times the first's work.
//   Backward (flash attention's, recomputing with the saved lse rather than
// keeping every block's probabilities): with delta = rowsum(dO * O), a block
// with P = exp(S - lse) gives dV += P^T dO, dS = P * (dO V^T - delta), dQ +=
// scale dS K, dK += scale dS^T Q. dQ stays on its rank; dK and dV of a chunk
// are accumulated by every rank that attended to it: the accumulator travels
// with the chunk (as in the ring attention papers), so the backward sends
// the k/v chunk again (cp - 1 messages, started before the block's work),
// the accumulator after each round (cp - 1), and the finished accumulator
// home (1): 2*cp - 1 send/recv pairs per rank. Recomputing costs one more
// QK^T per block than saving P, but keeps the memory of the forward at
// O(S_local) per query instead of O(S_local * S).
//   Reduced precision (bf16, f16) keeps each block's scores, softmax and
// lse, the running output, dQ and the dK/dV accumulators in float32 (the
// matmuls stay in the input dtype) and casts at the end: a bf16 lse of
// magnitude ~5 would carry an absolute error of 1e-2, a relative one in
// every weight exp(lse_b - lse) it forms (measured at cp 4: relative error
// 6.5e-3 with bf16 blocks against one device's bf16 attention's 3.5e-3).
constexpr int kKvTag = 0x4350, kGradTag = 0x4351;  // "CP"

struct GroupHolder : torch::CustomClassHolder {
  explicit GroupHolder(ProcessGroup g) : group(std::move(g)) {}
  ProcessGroup group;
};

// One rank's k and v as one flat message: k, then v.
at::Tensor packKv(const at::Tensor& k, const at::Tensor& v) { return at::cat({k.reshape(-1), v.reshape(-1)}); }
int64_t kvNumel(const AttentionShape& s, int64_t len) { return s.batch * s.kv_heads * len * (s.head_dim + s.v_dim); }

struct KvView {
  at::Tensor k5, v5;  // [B, Hkv, 1, len, D], [B, Hkv, 1, len, Dv]: views of the message
};
KvView unpackKv(const at::Tensor& buf, const AttentionShape& s, int64_t len) {
  const int64_t kn = s.batch * s.kv_heads * len * s.head_dim;
  return {buf.narrow(0, 0, kn).view({s.batch, s.kv_heads, 1, len, s.head_dim}),
          buf.narrow(0, kn, buf.numel() - kn).view({s.batch, s.kv_heads, 1, len, s.v_dim})};
}

// The blocking recv checks the sender's shape before any byte moves; its
// error gains what ring attention expected and why they can differ.
void recvChunk(const ProcessGroup& group, at::Tensor buf, int src, int tag, const AttentionShape& s, int owner,
               const char* what) {
  try {
    group.recv(std::move(buf), src, tag);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "ring_attention: receiving the ", what, " of cp rank ", owner, "'s chunk (",
                context_parallel_local_len(s.seq_len, s.cp_size, owner, s.layout), " positions under the ",
                to_string(s.layout), " layout of seq_len ", s.seq_len, ") from cp rank ", src, " failed: ",
                e.what_without_backtrace(), " Every rank must pass the same seq_len; an uneven sequence needs "
                "CpAttentionOptions::seq_len(S).");
  }
}

// The blocks of this rank's query segments against the chunk of rank `owner`.
template <typename F>
void forEachBlock(const AttentionShape& s, int owner, c10::Device device, F&& f) {
  const auto q_segs = context_parallel_segments(s.seq_len, s.cp_size, s.cp_rank, s.layout);
  const auto k_segs = context_parallel_segments(s.seq_len, s.cp_size, owner, s.layout);
  int64_t k_off = 0;
  for (const auto& ks : k_segs) {
    int64_t q_off = 0;
    for (size_t qi = 0; qi < q_segs.size(); ++qi) {
      const SeqSegment& qs = q_segs[qi];
      const BlockKind kind = blockKind(qs, ks, s.causal, s.window);
      if (kind != BlockKind::Skip)
        f(qi, q_off, qs.length, k_off, ks.length,
          kind == BlockKind::Masked ? causalMask(qs, ks, device, s.window) : at::Tensor());
      q_off += qs.length;
    }
    k_off += ks.length;
  }
}

AttentionShape shapeOf(const char* api, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const ProcessGroup& group, bool causal, double scale, int64_t layout, int64_t seq_len,
                       int64_t window) {
  return checkAttention(api, q, k, v, group,
                        CpAttentionOptions().causal(causal).scale(scale).layout(static_cast<CpLayout>(layout))
                            .seq_len(seq_len).window(window));
}

struct RingAttention : public torch::autograd::Function<RingAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, ProcessGroup group, bool causal, double scale, int64_t layout,
                            int64_t seq_len, int64_t window) {
    const AttentionShape s = shapeOf("ring_attention", q, k, v, group, causal, scale, layout, seq_len, window);
    const int n = s.cp_size, r = s.cp_rank, next = (r + 1) % n, prev = (r + n - 1) % n;
    const std::vector<int64_t> lens = localLens(s.seq_len, n, s.layout);
    const auto acc = q.options().dtype(accumulationType(q.scalar_type()));
    const at::Tensor q5 = groupQueryHeads(q, s.kv_heads);
    std::vector<at::Tensor> outs, lses;
    for (const auto& seg : context_parallel_segments(s.seq_len, n, r, s.layout)) {
      outs.push_back(at::zeros({s.batch, s.kv_heads, s.group, seg.length, s.v_dim}, acc));
      lses.push_back(at::full({s.batch, s.kv_heads, s.group, seg.length}, -std::numeric_limits<double>::infinity(), acc));
    }
    at::Tensor cur = packKv(k, v);
    for (int i = 0; i < n; ++i) {
      const int owner = (r - i + n) % n;
      Work sent;
      if (i + 1 < n) sent = group.isend(cur, next, kKvTag);
      const KvView kv = unpackKv(cur, s, lens[owner]);
      forEachBlock(s, owner, q.device(), [&](size_t qi, int64_t q_off, int64_t q_len, int64_t k_off, int64_t k_len,
                                             const at::Tensor& hidden) {
        mergeBlock(outs[qi], lses[qi],
                   blockForward(q5.narrow(3, q_off, q_len), kv.k5.narrow(3, k_off, k_len),
                                kv.v5.narrow(3, k_off, k_len), s.scale, hidden));
      });
      if (i + 1 < n) {
        const int from = (owner + n - 1) % n;
        at::Tensor buf = at::empty({kvNumel(s, lens[from])}, cur.options());
        recvChunk(group, buf, prev, kKvTag, s, from, "keys and values");
        sent.wait();
        cur = std::move(buf);
      }
    }
    const at::Tensor out = at::cat(outs, 3).reshape({s.batch, s.heads, s.local_len, s.v_dim}).to(q.scalar_type());
    ctx->save_for_backward({q, k, v, out, at::cat(lses, 3)});
    ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupHolder>(group));
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["layout"] = layout;
    ctx->saved_data["seq_len"] = s.seq_len;
    ctx->saved_data["window"] = window;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const ProcessGroup group =
        c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data["group"].toCapsule())->group;
    const AttentionShape s = shapeOf("ring_attention", q, k, v, group, ctx->saved_data["causal"].toBool(),
                                     ctx->saved_data["scale"].toDouble(), ctx->saved_data["layout"].toInt(),
                                     ctx->saved_data["seq_len"].toInt(), ctx->saved_data["window"].toInt());
    const int n = s.cp_size, r = s.cp_rank, next = (r + 1) % n, prev = (r + n - 1) % n;
    const std::vector<int64_t> lens = localLens(s.seq_len, n, s.layout);
    const auto acc = q.options().dtype(accumulationType(q.scalar_type()));
    const at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(out);
    const at::Tensor q5 = groupQueryHeads(q, s.kv_heads), dout5 = groupQueryHeads(dout, s.kv_heads);
    const at::Tensor delta = (dout5.to(acc.dtype()) * groupQueryHeads(out, s.kv_heads)).sum(-1);
    at::Tensor dq5 = at::zeros(q5.sizes(), acc);
    at::Tensor kv = packKv(k, v);
    at::Tensor dkv = at::zeros({kv.numel()}, acc);
    for (int i = 0; i < n; ++i) {
      const int owner = (r - i + n) % n;
      Work kv_sent;
      if (i + 1 < n) kv_sent = group.isend(kv, next, kKvTag);
      const KvView chunk = unpackKv(kv, s, lens[owner]), grad = unpackKv(dkv, s, lens[owner]);
      forEachBlock(s, owner, q.device(), [&](size_t, int64_t q_off, int64_t q_len, int64_t k_off, int64_t k_len,
                                             const at::Tensor& hidden) {
        blockBackward(q5.narrow(3, q_off, q_len), chunk.k5.narrow(3, k_off, k_len), chunk.v5.narrow(3, k_off, k_len),
                      dout5.narrow(3, q_off, q_len), lse.narrow(3, q_off, q_len), delta.narrow(3, q_off, q_len),
                      s.scale, hidden, dq5.narrow(3, q_off, q_len), grad.k5.narrow(3, k_off, k_len),
                      grad.v5.narrow(3, k_off, k_len));
      });
      if (i + 1 < n) {
        Work grad_sent = group.isend(dkv, next, kGradTag);
        const int from = (owner + n - 1) % n;
        at::Tensor kv_buf = at::empty({kvNumel(s, lens[from])}, kv.options());
        at::Tensor dkv_buf = at::empty({kvNumel(s, lens[from])}, acc);
        recvChunk(group, kv_buf, prev, kKvTag, s, from, "keys and values");
        recvChunk(group, dkv_buf, prev, kGradTag, s, from, "key/value gradient accumulator");
        kv_sent.wait();
        grad_sent.wait();
        kv = std::move(kv_buf);
        dkv = std::move(dkv_buf);
      }
    }
    if (n > 1) {  // dkv now holds rank r+1's finished gradients; rank r-1 holds ours
      Work grad_sent = group.isend(dkv, next, kGradTag);
      at::Tensor mine = at::empty({kvNumel(s, lens[r])}, acc);
      recvChunk(group, mine, prev, kGradTag, s, r, "key/value gradients");
      grad_sent.wait();
      dkv = std::move(mine);
    }
    const KvView g = unpackKv(dkv, s, s.local_len);
    const auto dt = q.scalar_type();
    return {dq5.reshape(q.sizes()).to(dt), g.k5.reshape(k.sizes()).to(dt), g.v5.reshape(v.sizes()).to(dt),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace
}  // namespace cp

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const ProcessGroup& group,
                          const CpAttentionOptions& options) {
  // Every user error before the first message, so that no rank is left waiting.
  const cp::AttentionShape s = cp::checkAttention("ring_attention", q, k, v, group, options);
  return cp::RingAttention::apply(q, k, v, group, s.causal, s.scale, static_cast<int64_t>(s.layout), s.seq_len,
                                  s.window);
}

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const DeviceMesh& mesh,
                          const CpAttentionOptions& options) {
  return ring_attention(q, k, v, cp::groupOfMesh("ring_attention", mesh), options);
}

}  // namespace dtp
