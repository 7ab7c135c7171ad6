// A KV cache for the reference Llama (library dtp::inference; the name
// stays reachable as dtp::models::KVCache): per layer, this rank's KV heads of
// every cached token, preallocated for max_batch x max_seq on first use.
//
//   models::KVCache cache(/*max_batch=*/4, /*max_seq=*/256);
//   at::Tensor logits = model->forward(prompts, cache, lengths);   // prefill: [B, 1, vocab]
//   logits = model->forward(next_tokens, cache, {1, 1, 1, 1});     // decode: one token each
//
// NOTE: [KV cache positions] Sequence b's tokens sit at positions
// lengths()[b], lengths()[b] + 1, ... of this call (its own rotary offset);
// a call writes all S positions of its [B, S] tokens (right padding
// included) but advances lengths()[b] by valid[b] only, so the next call
// overwrites the padding. A query at position p attends keys 0..p of its own
// sequence, so padding never reaches a valid token.
//
// NOTE: [Paged KV cache] KVCache::paged(num_blocks, block_size) holds, per
// layer, one pool of num_blocks x block_size token slots
// [num_blocks * block_size, kv_heads, head_dim]. The caller owns the blocks
// (which are free, which sequence holds which) and gives each forward its
// batch as block tables: token j of sequence b sits in slot
// tables[b][j / block_size] * block_size + j % block_size. A call
//  - writes its valid tokens' keys and values at their slots (index_copy;
//    right padding is never written, so a table needs room for the valid
//    tokens only);
//  - reads keys 0..keys-1 of each sequence by gathering their slots
//    (index_select) into [B, keys, kv_heads, head_dim], then runs the
//    contiguous cache's attention math on it. Keys past a sequence's tokens
//    gather slot 0 and are masked, as the contiguous cache's stale rows are.
// Example: block_size 4, tables {{7, 2}, {0}}, lengths {5, 1}, one decode
// token each: sequence 0's new token (position 5) goes to slot 2*4 + 1 = 9,
// sequence 1's (position 1) to slot 1; keys = 6, and sequence 0 reads slots
// 28 29 30 31 8 9, sequence 1 reads 0 1 0 0 0 0 (the last four masked).
//
// NOTE: [Packed batch] set_batch(tables, lengths, /*packed=*/true) makes the
// next forward a flattened one (vLLM v1's): its tokens are [1, T], the
// valid tokens of every sequence one after another (valid[b] of sequence
// b, T = their sum, no padding), so decode rows (1 token) and prefill
// chunks (many) run in one forward whose projections and MLPs cost T rows,
// not B x the longest. Attention alone regroups: rows with one token and
// rows with more form two groups, each gathered into [rows, its longest]
// (padding repeats the row's last token and is dropped), attended as a
// paged call would, and scattered back to [1, T]. The forward returns the
// logits of each sequence's last token, [B, 1, V], as unpacked.
// Example: valid {1, 3, 1} gives tokens t0 | t1 t2 t3 | t4; the groups are
// rows {0, 2} of width 1 (tokens 0 and 4) and row {1} of width 3.
//
// NOTE: [KV cache sharded over cp] shard_blocks(group) spreads a paged
// cache's blocks over the ranks of `group` (a context-parallel group, whose
// ranks run the same calls on the same batch): block b lives on rank
// b % size only, as its local block b / size, so each rank allocates
// ceil(num_blocks / size) blocks and the pool holds size times what one
// rank could. A call then
//  - writes a token's keys and values on the rank holding its block only;
//  - attends on each rank over the keys it holds (the others masked) and
//    keeps, per query row and head, the partial output and its log-sum-exp
//    (lse = -inf where a rank holds none of the keys the row sees);
//  - merges the ranks' partials in one all_gather per layer: lse =
//    logsumexp_r(lse_r), out = sum_r exp(lse_r - lse) out_r. That is the
//    softmax over the union of the ranks' keys, exactly (flash-decoding's
//    merge; ring attention's, NOTE: [Ring attention]).
// Everything else (projections, MLPs, the head) runs on every rank alike, so
// every rank ends the call with the same output. Blocks given out in order
// (0, 1, 2, ...) alternate ranks, so a sequence's keys, and the attention's
// work, spread evenly; any assignment is exact. Example: 5 blocks over 2
// ranks: rank 0 holds blocks 0, 2, 4 as its local 0, 1, 2, rank 1 blocks 1
// and 3 as its local 0 and 1 (and one spare).
#pragma once

#include "dtp/process_group.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace dtp::inference {

class KVCache {
 public:
  KVCache(int64_t max_batch, int64_t max_seq);
  // A paged cache (NOTE: [Paged KV cache]): num_blocks blocks of block_size
  // tokens per layer, allocated on first use (or by layer()).
  static KVCache paged(int64_t num_blocks, int64_t block_size);

  int64_t max_batch() const { return max_batch_; }  // contiguous (0 when paged)
  int64_t max_seq() const { return max_seq_; }
  // Tokens cached per sequence of the current batch.
  const std::vector<int64_t>& lengths() const { return lengths_; }
  // Starts a new batch of `batch` empty sequences (memory is kept).
  void reset(int64_t batch);
  // Keeps only the sequences `rows` (ascending indices into the current
  // batch), moved to its front in that order: generation drops finished
  // sequences so that they stop costing compute.
  void keep(const std::vector<int64_t>& rows);

  bool is_paged() const { return block_size_ > 0; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_size() const { return block_size_; }
  // Paged: the batch of the next forward: sequence b has lengths[b] tokens
  // cached in the blocks tables[b] (in order), which must have room for
  // them and for the call's valid tokens. lengths() then advance as usual.
  void set_batch(std::vector<std::vector<int64_t>> tables, std::vector<int64_t> lengths, bool packed = false);
  // Whether the next forward is packed (NOTE: [Packed batch]).
  bool packed() const { return packed_; }
  // Spreads the blocks over `group`'s ranks (NOTE: [KV cache sharded over
  // cp]); every rank of the group makes the same calls with the same block
  // tables. Paged only, before the first forward.
  void shard_blocks(ProcessGroup group);
  bool is_sharded() const { return shards_ > 1; }
  const ProcessGroup& shard_group() const { return shard_group_; }
  // Blocks allocated on this rank: num_blocks, or ceil(num_blocks / size)
  // when sharded.
  int64_t local_blocks() const { return (num_blocks_ + shards_ - 1) / shards_; }

  // Used by the Llama's forward (see llama_kv.cpp).
  struct Step {
    std::vector<int64_t> start;  // lengths() before the call
    at::Tensor positions;        // [B, S] i64: start[b] + s
    int64_t keys = 0;            // max(start) + S: keys attended
    // Paged only (NOTE: [Paged KV cache]):
    // The tokens written: rows of the call's [B*S] (packed: of [T]); undefined:
    // all rows. Sharded: those whose block this rank holds.
    at::Tensor write_rows;
    at::Tensor write_slots;  // [T] i64: their slots (sharded: local slots)
    at::Tensor read_slots;   // [B, keys] i64: the slot of each sequence's key j
    at::Tensor read_held;    // sharded only: [B, keys] bool, key j is held on this rank
    // Packed only (NOTE: [Packed batch]): attention's groups of rows.
    struct Group {
      int64_t keys = 0;      // keys attended: max(start + valid) over the group
      at::Tensor gather;     // [G, S] i64: each row's tokens as indices into [T] (padding: its last)
      at::Tensor positions;  // [G, S] i64: their positions
      at::Tensor read;       // [G, keys] i64: the slot of each row's key j
      at::Tensor held;       // sharded only: [G, keys] bool, key j is held on this rank
      at::Tensor valid;      // [Tg] i64: the real entries of the flattened [G * S]
      at::Tensor dest;       // [Tg] i64: where they go in [T]
    };
    std::vector<Group> groups;
  };
  // The layer's cache, allocated like `like` ([B, S, kv_heads, head_dim]):
  // [max_batch, max_seq, kv_heads, head_dim], or paged the pool
  // [num_blocks * block_size, kv_heads, head_dim].
  std::pair<at::Tensor, at::Tensor> layer(int64_t index, const at::Tensor& like);
  void begin(const std::vector<int64_t>& valid, int64_t seq);
  void end(const std::vector<int64_t>& valid);
  const Step& step() const { return step_; }
  // The cache of the forward running on this thread (nullptr: none).
  static KVCache* active();
  struct Activate {
    explicit Activate(KVCache* c);
    ~Activate();
    KVCache* prev;
  };

 private:
  void pagedSlots(const std::vector<int64_t>& valid, int64_t seq);
  // Token j of a sequence with blocks `table`: its slot in this rank's pool,
  // or -1 when another rank holds its block (NOTE: [KV cache sharded over cp]).
  int64_t localSlot(const std::vector<int64_t>& table, int64_t j) const;

  int64_t max_batch_, max_seq_;
  int64_t num_blocks_ = 0, block_size_ = 0;  // paged when block_size_ > 0
  void packedSteps(const std::vector<int64_t>& valid);

  bool packed_ = false;
  ProcessGroup shard_group_;
  int64_t shard_rank_ = 0, shards_ = 1;
  std::vector<std::vector<int64_t>> tables_;
  std::vector<int64_t> lengths_;
  std::vector<at::Tensor> k_, v_;
  Step step_;
};

}  // namespace dtp::inference

namespace dtp::models {
using inference::KVCache;  // its name before the move (NOTE: [Moved headers] in dtp/models/tokenizer.h)
}  // namespace dtp::models
