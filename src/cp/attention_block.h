// What ring and all-to-all attention share: the checks of one call and the
// attention of one block of queries against one block of keys, with its
// log-sum-exp, merged exactly. See NOTE: [Ring attention] in
// src/cp/ring_attention.cpp.
#pragma once

#include "dtp/cp/context_parallel.h"

#include <ATen/core/Tensor.h>

namespace dtp::cp {

// One call's shapes, checked against each other and against the layout.
struct AttentionShape {
  int64_t batch = 0, heads = 0, kv_heads = 0, group = 1, head_dim = 0, v_dim = 0, local_len = 0, seq_len = 0;
  int cp_size = 1, cp_rank = 0;
  double scale = 1.0;
  bool causal = false;
  int64_t window = 0;  // CpAttentionOptions::window: 0, or > 0 with causal
  CpLayout layout = CpLayout::Contiguous;
};
// `api` prefixes every error ("ring_attention").
AttentionShape checkAttention(const char* api, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const ProcessGroup& group, const CpAttentionOptions& options);
// The 1-D mesh's group, or an error naming the mesh.
ProcessGroup groupOfMesh(const char* api, const DeviceMesh& mesh);

// [B, H, S, D] -> [B, H_kv, H / H_kv, S, D]: query head h under key/value
// head h / (H / H_kv), as PyTorch's enable_gqa (repeat_interleave).
at::Tensor groupQueryHeads(const at::Tensor& q, int64_t kv_heads);

// The dtype a block's softmax, its lse and the running sums are kept in:
// float32 for bf16 and f16 inputs (as flash attention's), else the input's.
at::ScalarType accumulationType(at::ScalarType t);

// A (query segment, key segment) pair under the causal mask (and the
// sliding window, `window` > 0): no key visible (skipped), every key
// visible, or some (the diagonal, the window's edge).
enum class BlockKind : uint8_t { Skip, Full, Masked };
BlockKind blockKind(const SeqSegment& q, const SeqSegment& k, bool causal, int64_t window = 0);
// bool [Sq, Sk], true where the key is hidden: after the query, or with
// `window` > 0 window or more positions before it.
at::Tensor causalMask(const at::Tensor& q_positions, const at::Tensor& k_positions, int64_t window = 0);
at::Tensor causalMask(const SeqSegment& q, const SeqSegment& k, c10::Device device, int64_t window = 0);

// Attention of q5 [B, Hkv, g, Sq, D] against k5 [B, Hkv, 1, Sk, D], v5
// [B, Hkv, 1, Sk, Dv]: out [B, Hkv, g, Sq, Dv] normalised over these keys
// alone, and lse [B, Hkv, g, Sq] (-inf for a query that sees no key here,
// whose out is 0). `hidden` (bool [Sq, Sk]) or undefined. The scores, lse
// and softmax in accumulationType; the matmuls in the input dtype.
struct Block {
  at::Tensor out, lse;
};
Block blockForward(const at::Tensor& q5, const at::Tensor& k5, const at::Tensor& v5, double scale,
                   const at::Tensor& hidden);
// Folds `b` into the running (out, lse) of the same queries: exact, as if
// both blocks' keys had been one softmax.
void mergeBlock(at::Tensor& out, at::Tensor& lse, const Block& b);
// The gradients of one block given the final lse of its queries and delta =
// rowsum(dout * out) (flash attention's backward): adds into dq5, dk5, dv5.
void blockBackward(const at::Tensor& q5, const at::Tensor& k5, const at::Tensor& v5, const at::Tensor& dout5,
                   const at::Tensor& lse, const at::Tensor& delta, double scale, const at::Tensor& hidden,
                   at::Tensor dq5, at::Tensor dk5, at::Tensor dv5);  // views: added into in place

}  // namespace dtp::cp
