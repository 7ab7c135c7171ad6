// Context parallelism: attention over a sequence sharded across the ranks of
// a cp group, exact against one device (PyTorch's
// torch.distributed.tensor.experimental.context_parallel, torchtitan's
// --parallelism.context_parallel_degree, Megatron's CP, DeepSpeed's Ulysses).
//
//   auto opts = dtp::CpAttentionOptions().causal(true).layout(dtp::CpLayout::HeadTail).seq_len(S);
//   at::Tensor q = dtp::context_parallel_shard(q_full, /*seq_dim=*/2, cp_group, opts.layout());  // and k, v
//   at::Tensor out = dtp::ring_attention(q, k, v, cp_group, opts);           // [B, H, S_local, Dv]
//   at::Tensor pos = dtp::context_parallel_position_ids(S, cp_group, opts.layout());  // rotary positions
//   at::Tensor full = dtp::context_parallel_unshard(out, 2, S, cp_group, opts.layout());
//
// Every rank passes its local q, k and v ([B, H, S_local, D], k and v with
// H_kv heads, H a multiple of H_kv: GQA, query head h uses key/value head
// h / (H / H_kv) as PyTorch's enable_gqa), holding the positions the layout
// gives it. In the Llama: a "cp" mesh dimension in parallelize_llama
// (apply_context_parallel, dtp/models/parallelize.h). See docs/long-context.md.
#pragma once

#include "dtp/device_mesh.h"
#include "dtp/process_group.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>

#include <cstdint>
#include <vector>

namespace dtp {

// Which positions of the global sequence each cp rank holds.
//   Contiguous: torch.chunk(S, cp), rank r holds chunk r (as Shard(seq_dim):
//     S = 10, cp = 4 -> lengths 3, 3, 3, 1).
//   HeadTail: the sequence cut into 2*cp chunks, rank r holds chunks r and
//     2*cp-1-r (torchtitan's and Megatron's load balancing for causal masks:
//     every rank gets one early and one late chunk). S >= 2*cp; chunk
//     lengths differ by at most one, only head chunks vary (S = 15, cp = 4 ->
//     rank 0 holds [0,1) and [13,15)). See NOTE: [Head-tail chunk lengths]
//     in src/cp/layout.cpp.
enum class CpLayout : uint8_t { Contiguous, HeadTail };
const char* to_string(CpLayout layout);

// One run of global positions [start, start + length) that a rank holds;
// its local sequence is its segments concatenated in order.
struct SeqSegment {
  int64_t start = 0, length = 0;
};

// The segments of cp rank `cp_rank` of `cp_size` under `layout` for a global
// sequence of `seq_len` (no communication).
std::vector<SeqSegment> context_parallel_segments(int64_t seq_len, int64_t cp_size, int64_t cp_rank,
                                                  CpLayout layout);
// The sum of this rank's segment lengths.
int64_t context_parallel_local_len(int64_t seq_len, int64_t cp_size, int64_t cp_rank, CpLayout layout);

// This rank's global positions, int64 [S_local]: index the rotary table with
// them (freqs.index_select(0, positions)) so that the rotary embedding
// follows the layout.
at::Tensor context_parallel_position_ids(int64_t seq_len, const ProcessGroup& group, CpLayout layout,
                                        c10::Device device = c10::kCPU);

// This rank's part of a global tensor along `seq_dim` (local slicing, no
// communication, differentiable).
at::Tensor context_parallel_shard(const at::Tensor& x, int64_t seq_dim, const ProcessGroup& group, CpLayout layout);
// The global tensor from every rank's local part (one all_gather over
// `group`, then the segments put back in position order). Not
// differentiable.
at::Tensor context_parallel_unshard(const at::Tensor& local, int64_t seq_dim, int64_t seq_len,
                                   const ProcessGroup& group, CpLayout layout);

struct CpAttentionOptions {
  // The causal mask of the global sequence (key position <= query position).
  TORCH_ARG(bool, causal) = false;
  // Softmax scale; default 1 / sqrt(D).
  TORCH_ARG(c10::optional<double>, scale) = c10::nullopt;
  TORCH_ARG(CpLayout, layout) = CpLayout::Contiguous;
  // The global sequence length; 0: cp * S_local, the even case (every rank
  // holds S / cp). Give it when S does not divide: each rank then knows
  // every rank's length, and a rank whose S_local is not the layout's is an
  // error naming both.
  TORCH_ARG(int64_t, seq_len) = 0;
  // A sliding window (Mistral's sliding_window): with `causal`, a query at
  // position i sees the keys at i - window + 1 .. i; 0: no window. Blocks
  // wholly outside it are skipped as those above the diagonal are.
  TORCH_ARG(int64_t, window) = 0;
};

// Ring attention: each rank keeps its queries and passes its key/value
// chunk around the ring (to cp rank r+1, from r-1), computing attention
// against each chunk and merging the partial results with their
// log-sum-exp (exact). Blocks wholly above the causal diagonal (or outside
// the sliding window) are skipped.
// Forward: cp - 1 send/recv pairs per rank; backward: 2*cp - 1 (the k/v
// chunks again, cp - 1, and the dk/dv accumulators that travel with them, cp,
// the last one home). Differentiable in q, k and v. See NOTE: [Ring
// attention] in src/cp/ring_attention.cpp.
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const ProcessGroup& group,
                          const CpAttentionOptions& options = {});
// The same over a 1-D mesh (mesh["cp"]).
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const DeviceMesh& mesh,
                          const CpAttentionOptions& options = {});

// All-to-all attention (DeepSpeed's Ulysses): q, k and v go from sequence-
// sharded to head-sharded (one all_to_all each), every rank attends over the
// whole sequence with H / cp query heads (H_kv / cp key/value heads), and the
// output goes back to sequence-sharded: 4 all_to_alls forward, 4 backward.
// H and H_kv must divide by cp. Differentiable in q, k and v.
at::Tensor all_to_all_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const ProcessGroup& group, const CpAttentionOptions& options = {});
at::Tensor all_to_all_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const DeviceMesh& mesh, const CpAttentionOptions& options = {});

}  // namespace dtp
