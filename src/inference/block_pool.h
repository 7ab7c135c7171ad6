// The KV blocks of the serving engine's paged cache (NOTE: [Paged KV cache]
// in include/dtp/inference/kv_cache.h): which are free, who holds which, and
// with prefix caching which full blocks hold which tokens, so that a request
// whose prompt starts like an earlier one reuses its keys and values
// (vLLM's automatic prefix caching: KVCacheManager + BlockPool).
//
// NOTE: [Prefix cache] A full block's identity is its parent's identity and
// its block_size tokens, so equal tokens after different prefixes are
// different blocks. Each block that becomes full is registered under a
// chained hash, hash(parent's hash, tokens) from a fixed root: the same on
// every rank and every run (no seed, no pointers), because every rank runs
// the same allocations in the same order and must take the same decisions
// (NOTE: [Serving step] in model_runner.h). A hash only finds a candidate: a cached block also
// keeps its tokens and its parent's registration (a number never reused),
// and a match compares both, so a collision can never hand out another
// prefix's keys and values. Rules:
//  - match(tokens) walks the prompt's full blocks from the first and stops
//    at the first that is not cached; it never covers the last token: at
//    most (tokens.size() - 1) / block_size blocks (vLLM v1's
//    max_cache_hit_length = num_tokens - 1, for the last token's logits). A
//    prompt of exactly k full blocks matches at most k - 1 and recomputes
//    its whole last block; 400 tokens at block_size 16: 24 of 25 blocks;
//    401 tokens: 25.
//  - commit registers the blocks a sequence filled, in order. A block
//    whose (parent, tokens) is cached already under another id stays
//    uncached (the first is kept, as vLLM does) and is the parent of the
//    sequence's next block. When a parent's registration is gone (evicted),
//    the blocks after it are not registered, and a cached block left behind
//    by an evicted parent (an orphan: no match reaches it) gives way when
//    its hash comes again. vLLM would reach it again through the hash once
//    the parent is recomputed; we cannot tell that parent equal without its
//    tokens, so we do not.
//  - A block no one holds is free (on a stack: the last given back is the
//    next taken; without prefix caching every block goes there) or, cached,
//    evictable (a list, least recently given back first). take() takes a
//    free block first and evicts only when none is left: the least
//    recently given back cached block no one holds, whose hash is dropped.
//  - give_back walks a sequence's blocks from its last to its first, so
//    that of one sequence the tail is evicted before the head (vLLM's
//    free_blocks(reversed(blocks))) and, free, the head is taken first.
// Every call costs O(blocks it touches x block_size): a hash map, an
// intrusive list, no scan of the pool.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace dtp::inference {

// The chained hash of a full block: hash(parent's hash, its n tokens).
using BlockHashFn = uint64_t (*)(uint64_t parent, const int64_t* tokens, int64_t n);

// Counters for /metrics (vLLM's prefix_cache_queries and _hits count
// tokens).
struct PrefixCacheStats {
  int64_t queries = 0;        // prompt tokens looked up by hold_prefix
  int64_t hits = 0;           // of them, tokens found in the cache
  int64_t evictions = 0;      // cached blocks take() evicted
  int64_t cached_blocks = 0;  // blocks registered now, held or not
};

class BlockPool {
 public:
  BlockPool(int64_t num_blocks, int64_t block_size, bool prefix_caching);

  int64_t total() const { return total_; }
  int64_t block_size() const { return block_size_; }
  bool prefix_caching() const { return caching_; }
  // Blocks take() can return now: free ones and cached ones no one holds.
  int64_t free() const { return static_cast<int64_t>(free_.size()) + evictable_; }
  int64_t used() const { return total_ - free(); }
  // Holders of a block (0: free or evictable). Leaving rows give back to
  // free() only the blocks they alone hold; holding a matched block no one
  // holds takes it out of free().
  int64_t refcount(int64_t block) const;
  bool is_cached(int64_t block) const;

  // A fresh block, held once: a free one, else the least recently given
  // back cached block no one holds (its hash dropped). The caller checked
  // free() first.
  int64_t take();
  // Releases a sequence's blocks (one hold each), from its last to its
  // first, and clears `blocks`. See NOTE: [Prefix cache].
  void give_back(std::vector<int64_t>& blocks);

  // The cached blocks of the longest prefix of `tokens` made of full blocks,
  // in order, leaving at least the last token to compute (NOTE: [Prefix
  // cache]); takes nothing. Empty without prefix caching. A take() before
  // hold() may evict them: hold what you matched before taking.
  std::vector<int64_t> match(const std::vector<int64_t>& tokens) const;
  // One more hold on each block: a matched block, or one held already.
  void hold(const std::vector<int64_t>& blocks);
  // A request's admission: match(tokens), hold them and count the query
  // (stats().queries += tokens.size(), hits += matched tokens).
  std::vector<int64_t> hold_prefix(const std::vector<int64_t>& tokens);
  // After a forward: tokens [0, cached) of the sequence `tokens` are in the
  // blocks `table`; registers the blocks that became full since the last
  // call. No-op without prefix caching.
  void commit(const std::vector<int64_t>& table, const std::vector<int64_t>& tokens, int64_t cached);

  const PrefixCacheStats& stats() const { return stats_; }

  // dtp's block hash (splitmix64 over the parent's hash and each token) and
  // the root's, the parent of a prompt's first block.
  static uint64_t chain_hash(uint64_t parent, const int64_t* tokens, int64_t n);
  static constexpr uint64_t kRootHash = 0x6474705f726f6f74ull;  // "dtp_root"
  // Tests only: another hash (a constant one collides everywhere). Only
  // while nothing is cached.
  void set_hash_for_testing(BlockHashFn fn);

 private:
  struct Block {
    int64_t ref = 0;
    bool cached = false;  // registered, in by_hash_ under `hash`
    bool seen = false;    // commit has examined it full
    bool known = false;   // its content's registration is (owner, kid)
    uint64_t hash = 0;    // its content's chained hash (known only)
    uint64_t kid = 0;     // the registration of its content (0: the root)
    int64_t owner = -1;   // the block bearing that registration (itself when cached)
    uint64_t parent_kid = 0;    // cached: its parent's registration
    int64_t parent_owner = -1;  // cached: the block bearing it then (-1: the root)
    int64_t prev = -1, next = -1;  // in the evictable list
  };
  void checkBlock(int64_t block, const char* api) const;
  bool live(int64_t owner, uint64_t kid) const;
  const int64_t* tokensOf(int64_t block) const { return tokens_.data() + block * block_size_; }
  void unlink(int64_t block);
  void uncache(int64_t block);

  int64_t total_;
  int64_t block_size_;
  bool caching_;
  BlockHashFn hash_ = &chain_hash;
  std::vector<Block> blocks_;
  std::vector<int64_t> free_;  // a stack: the last given back is the next taken
  int64_t head_ = -1, tail_ = -1, evictable_ = 0;  // evictable list: head evicted first
  std::unordered_map<uint64_t, int64_t> by_hash_;  // chained hash -> the cached block
  std::vector<int64_t> tokens_;  // [total * block_size]: each cached block's tokens
  uint64_t next_kid_ = 0;        // registrations are numbered from 1, never reused
  PrefixCacheStats stats_;
};

}  // namespace dtp::inference
