// inference::BlockPool (src/inference/block_pool.h): the KV blocks of the
// serving engine and prefix caching (NOTE: [Prefix cache]). No tensors, no
// communication: block ids, refcounts and counters, against the old pool
// and against an obvious reference that scans the whole pool.
#include "inference/block_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace dtp::inference {
namespace {

using Ids = std::vector<int64_t>;

// dtp-serve's BlockPool before prefix caching (apps/dtp-serve/block_pool.h
// at 8814dd5), to check that the new one without caching takes the same ids.
class OldBlockPool {
 public:
  explicit OldBlockPool(int64_t num_blocks) : total_(num_blocks) {
    for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
  }
  int64_t free() const { return static_cast<int64_t>(free_.size()); }
  int64_t used() const { return total_ - free(); }
  int64_t take() {
    const int64_t b = free_.back();
    free_.pop_back();
    return b;
  }
  void give_back(Ids& blocks) {
    for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) free_.push_back(*it);
    blocks.clear();
  }

 private:
  int64_t total_;
  Ids free_;
};

Ids iota(int64_t n, int64_t from) {
  Ids v(n);
  std::iota(v.begin(), v.end(), from);
  return v;
}

Ids cat(Ids a, const Ids& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

Ids takeN(BlockPool& pool, int64_t n) {
  Ids ids;
  for (int64_t i = 0; i < n; ++i) ids.push_back(pool.take());
  return ids;
}

// A request's admission as the engine runs it: the matched blocks, then
// fresh ones for the rest of the prompt, then one forward over all of it.
Ids admitAndPrefill(BlockPool& pool, const Ids& prompt) {
  Ids table = pool.hold_prefix(prompt);
  const int64_t blocks = (static_cast<int64_t>(prompt.size()) + pool.block_size() - 1) / pool.block_size();
  while (static_cast<int64_t>(table.size()) < blocks) table.push_back(pool.take());
  pool.commit(table, prompt, static_cast<int64_t>(prompt.size()));
  return table;
}

std::string what(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(BlockPoolTest, WithoutCachingTakesTheOldPoolsIdsInItsOrder) {
  BlockPool pool(8, 16, /*prefix_caching=*/false);
  EXPECT_EQ(takeN(pool, 3), (Ids{0, 1, 2})) << "block 0 is taken first";
  Ids a{0, 1, 2};
  pool.give_back(a);
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(takeN(pool, 4), (Ids{0, 1, 2, 3})) << "a sequence given back: its head is taken first";

  // Random takes and give-backs of whole tables, with commits and prefix
  // lookups that must change nothing: the same ids as the old pool.
  std::mt19937_64 rng(56);
  for (bool caching_unused : {false, true}) {
    BlockPool fresh(37, 4, caching_unused);
    OldBlockPool old(37);
    std::vector<Ids> tables;
    for (int step = 0; step < 5000; ++step) {
      if (tables.empty() || (rng() % 3 != 0 && old.free() > 0)) {
        const int64_t n = 1 + static_cast<int64_t>(rng() % std::min<int64_t>(old.free(), 5));
        Ids mine, theirs;
        for (int64_t i = 0; i < n; ++i) {
          mine.push_back(fresh.take());
          theirs.push_back(old.take());
        }
        ASSERT_EQ(mine, theirs) << "step " << step << ", prefix_caching " << caching_unused;
        if (!caching_unused) {
          fresh.commit(mine, Ids(n * 4, 7), n * 4);  // a no-op without caching
          EXPECT_TRUE(fresh.hold_prefix(Ids(n * 4 + 1, 7)).empty());
        }
        tables.push_back(mine);
      } else {
        const size_t k = rng() % tables.size();
        Ids copy = tables[k];
        fresh.give_back(tables[k]);
        old.give_back(copy);
        tables.erase(tables.begin() + static_cast<std::ptrdiff_t>(k));
      }
      ASSERT_EQ(fresh.free(), old.free()) << "step " << step;
      ASSERT_EQ(fresh.used(), old.used()) << "step " << step;
    }
    EXPECT_EQ(fresh.stats().cached_blocks, 0);
    EXPECT_EQ(fresh.stats().queries, 0) << "without caching nothing is looked up";
  }
}

TEST(BlockPoolTest, ChainHashIsTheSameOnEveryRankAndRun) {
  const Ids t = iota(16, 1);
  // A golden value: no seed, no pointer, no std::hash.
  EXPECT_EQ(BlockPool::chain_hash(BlockPool::kRootHash, t.data(), 16), 0x89bcf0cbf1af4cf9ull);
  const uint64_t first = BlockPool::chain_hash(BlockPool::kRootHash, t.data(), 16);
  EXPECT_NE(BlockPool::chain_hash(first, t.data(), 16), first) << "the parent is part of the hash";
  Ids swapped = t;
  std::swap(swapped[0], swapped[1]);
  EXPECT_NE(BlockPool::chain_hash(BlockPool::kRootHash, swapped.data(), 16), first) << "the order is too";
}

TEST(BlockPoolTest, SharedSystemPromptOf400TokensIsMatchedByTheNextRequest) {
  BlockPool pool(100, 16, /*prefix_caching=*/true);
  const Ids system = iota(400, 1000);  // 25 full blocks
  const Ids a_prompt = cat(system, iota(30, 5000));
  // Request A prefills in three chunks (100, 156, 174 tokens).
  Ids a = pool.hold_prefix(a_prompt);
  EXPECT_TRUE(a.empty()) << "an empty cache finds nothing";
  for (int64_t i = 0; i < 27; ++i) a.push_back(pool.take());
  for (int64_t cached : {100, 256, 430}) pool.commit(a, a_prompt, cached);
  EXPECT_EQ(pool.stats().cached_blocks, 26) << "430 tokens fill 26 blocks; the 27th is partial";

  // B: the same system prompt, another question: all 25 system blocks.
  const Ids b_prompt = cat(system, iota(20, 9000));
  const Ids b_hit = pool.match(b_prompt);
  EXPECT_EQ(b_hit, Ids(a.begin(), a.begin() + 25));
  // The last-token rule: the system prompt alone (exactly 25 blocks) matches
  // 24 and recomputes its last block; one token more matches all 25.
  EXPECT_EQ(pool.match(system).size(), 24u);
  EXPECT_EQ(pool.match(cat(system, {1})).size(), 25u);
  EXPECT_EQ(pool.match(a_prompt).size(), 26u) << "A's own prompt: 430 tokens, 26 full blocks, last token left";
  EXPECT_EQ(pool.match(Ids(a_prompt.begin(), a_prompt.begin() + 416)).size(), 25u) << "416 tokens: 26 blocks, 25";

  const Ids b = admitAndPrefill(pool, b_prompt);
  EXPECT_EQ(Ids(b.begin(), b.begin() + 25), b_hit);
  for (int64_t i = 0; i < 25; ++i) EXPECT_EQ(pool.refcount(b[i]), 2) << "system block " << i << ": A and B";
  EXPECT_EQ(pool.refcount(b[25]), 1) << "B's own first block";
  EXPECT_EQ(pool.stats().queries, 430 + 420);
  EXPECT_EQ(pool.stats().hits, 400);
  EXPECT_EQ(pool.used(), 27 + 2) << "B took 2 blocks for its 20 own tokens";
}

TEST(BlockPoolTest, DifferentSuffixAfterSharedBlocksStopsTheMatch) {
  BlockPool pool(32, 4, /*prefix_caching=*/true);
  const Ids shared{1, 2, 3, 4, 5, 6, 7, 8};
  const Ids a_prompt = cat(shared, {9, 9, 9, 9, 8, 8, 8, 8, 0});
  const Ids a = admitAndPrefill(pool, a_prompt);
  EXPECT_EQ(pool.stats().cached_blocks, 4);
  // The third block differs, the fourth is equal: the match stops at the
  // third, the fourth (another prefix) is not A's.
  const Ids b_prompt = cat(shared, {9, 9, 9, 7, 8, 8, 8, 8, 0});
  EXPECT_EQ(pool.match(b_prompt), (Ids{a[0], a[1]}));
  const Ids b = admitAndPrefill(pool, b_prompt);
  EXPECT_EQ(pool.stats().cached_blocks, 6) << "B registers its own third and fourth blocks";
  EXPECT_NE(b[3], a[3]);
  EXPECT_EQ(pool.match(cat(b_prompt, {5})), Ids(b.begin(), b.begin() + 4));
  EXPECT_EQ(pool.match(cat(a_prompt, {5})), Ids(a.begin(), a.begin() + 4));
}

TEST(BlockPoolTest, EqualBlocksUnderDifferentParentsAreNotShared) {
  BlockPool pool(16, 4, /*prefix_caching=*/true);
  const Ids q{7, 7, 7, 7};
  const Ids a = admitAndPrefill(pool, cat({1, 1, 1, 1}, cat(q, {0})));
  EXPECT_TRUE(pool.match(cat({2, 2, 2, 2}, cat(q, {0}))).empty()) << "Q after another first block is not A's Q";
  const Ids b = admitAndPrefill(pool, cat({2, 2, 2, 2}, cat(q, {0})));
  EXPECT_EQ(pool.stats().cached_blocks, 4);
  EXPECT_EQ(pool.match(cat({1, 1, 1, 1}, cat(q, {0}))), (Ids{a[0], a[1]}));
  EXPECT_EQ(pool.match(cat({2, 2, 2, 2}, cat(q, {0}))), (Ids{b[0], b[1]}));
  EXPECT_TRUE(pool.match(cat(q, {0})).empty()) << "Q as a first block was never computed";
}

TEST(BlockPoolTest, TwoHoldersKeepABlockOutOfFreeUntilBothGiveItBack) {
  BlockPool pool(10, 4, /*prefix_caching=*/true);
  const Ids prompt = iota(13, 1);  // 3 full blocks and 1 token
  Ids a = admitAndPrefill(pool, prompt);
  EXPECT_EQ(pool.free(), 6);
  Ids b = admitAndPrefill(pool, prompt);
  EXPECT_EQ(Ids(b.begin(), b.begin() + 3), Ids(a.begin(), a.begin() + 3));
  EXPECT_EQ(pool.free(), 5) << "B shares 3 blocks and takes 1";
  for (int i = 0; i < 3; ++i) EXPECT_EQ(pool.refcount(a[i]), 2);
  const Ids shared(a.begin(), a.begin() + 3);
  pool.give_back(a);
  EXPECT_EQ(pool.free(), 6) << "A's partial block is free; the shared ones are still B's";
  for (int64_t s : shared) EXPECT_EQ(pool.refcount(s), 1);
  pool.give_back(b);
  EXPECT_EQ(pool.free(), 10) << "cached blocks no one holds count as free";
  EXPECT_EQ(pool.stats().cached_blocks, 3);
  // A third request holds them again: out of free() until it gives back.
  Ids c = pool.hold_prefix(prompt);
  EXPECT_EQ(c, shared);
  EXPECT_EQ(pool.free(), 7);
  pool.give_back(c);
  EXPECT_EQ(pool.free(), 10);
}

TEST(BlockPoolTest, EvictionTakesTheLeastRecentlyGivenBackTailFirstAndNeverAHeldBlock) {
  BlockPool pool(9, 2, /*prefix_caching=*/true);
  Ids a = admitAndPrefill(pool, {1, 1, 2, 2, 3, 3, 0});  // 3 full + 1
  Ids b = admitAndPrefill(pool, {4, 4, 5, 5, 0});        // 2 full + 1
  const Ids a_full(a.begin(), a.begin() + 3), b_full(b.begin(), b.begin() + 2);
  const int64_t a_partial = a[3], b_partial = b[2];
  pool.give_back(a);
  pool.give_back(b);
  Ids c = pool.hold_prefix({4, 4, 9});  // C holds B's first block
  EXPECT_EQ(c, (Ids{b_full[0]}));
  EXPECT_EQ(pool.free(), 8);
  // The free stack first: B's and A's partial blocks (given back last),
  // then the two never used.
  EXPECT_EQ(takeN(pool, 4), (Ids{b_partial, a_partial, 7, 8}));
  EXPECT_EQ(pool.stats().evictions, 0) << "free blocks go first";
  // Then A's blocks tail first, then B's second; B's first is C's.
  EXPECT_EQ(takeN(pool, 4), (Ids{a_full[2], a_full[1], a_full[0], b_full[1]}));
  EXPECT_EQ(pool.stats().evictions, 4);
  EXPECT_EQ(pool.stats().cached_blocks, 1);
  EXPECT_EQ(pool.free(), 0);
  const std::string error = what([&] { pool.take(); });
  EXPECT_NE(error.find("dtp::inference: BlockPool::take for a new KV block: got all 9 blocks held, expected at "
                       "least one free or evictable."), std::string::npos) << error;
  EXPECT_EQ(pool.match({4, 4, 9}), (Ids{b_full[0]})) << "the held block survived";
  EXPECT_TRUE(pool.match({1, 1, 0}).empty()) << "an evicted block's hash is dropped";
}

TEST(BlockPoolTest, TakeEvictsOnlyWhenTheFreeStackIsEmpty) {
  BlockPool pool(4, 2, /*prefix_caching=*/true);
  Ids a = admitAndPrefill(pool, {1, 2, 3, 4});  // 2 full blocks, both cached
  const Ids a_copy = a;
  pool.give_back(a);
  EXPECT_EQ(pool.free(), 4);
  EXPECT_EQ(takeN(pool, 2), (Ids{2, 3}));
  EXPECT_EQ(pool.stats().evictions, 0);
  EXPECT_EQ(pool.match({1, 2, 3, 4, 5}), a_copy) << "still cached while free blocks were left";
  EXPECT_EQ(pool.take(), a_copy[1]) << "A's tail goes first";
  EXPECT_EQ(pool.stats().evictions, 1);
  EXPECT_EQ(pool.match({1, 2, 3, 4, 5}), (Ids{a_copy[0]}));
  EXPECT_FALSE(pool.is_cached(a_copy[1]));
  EXPECT_EQ(pool.refcount(a_copy[1]), 1);
}

uint64_t constantHash(uint64_t, const int64_t*, int64_t) { return 42; }
uint64_t tokensOnlyHash(uint64_t, const int64_t* t, int64_t n) {
  return BlockPool::chain_hash(BlockPool::kRootHash, t, n);
}

TEST(BlockPoolTest, EqualHashesNeverHandOutAnotherPrefixsBlocks) {
  // Every block hashes alike: only the tokens tell them apart.
  BlockPool pool(16, 4, /*prefix_caching=*/true);
  pool.set_hash_for_testing(&constantHash);
  const Ids a = admitAndPrefill(pool, {1, 2, 3, 4, 5, 6, 7, 8, 0});
  EXPECT_EQ(pool.stats().cached_blocks, 1) << "A's second block collides with its first, which keeps the hash";
  EXPECT_EQ(pool.match({1, 2, 3, 4, 0}), (Ids{a[0]}));
  EXPECT_TRUE(pool.match({1, 2, 3, 5, 0}).empty()) << "same hash, other tokens: no hit";
  EXPECT_EQ(pool.match({1, 2, 3, 4, 5, 6, 7, 8, 0}), (Ids{a[0]})) << "the second block was never registered";

  // The hash ignores the parent: only the parent's registration tells
  // {1,2,3,4}{9,9,9,9} from {5,5,5,5}{9,9,9,9}.
  BlockPool parentless(16, 4, /*prefix_caching=*/true);
  parentless.set_hash_for_testing(&tokensOnlyHash);
  const Ids b = admitAndPrefill(parentless, {1, 2, 3, 4, 9, 9, 9, 9, 0});
  const Ids d = admitAndPrefill(parentless, {5, 5, 5, 5, 0});
  EXPECT_EQ(parentless.match({5, 5, 5, 5, 9, 9, 9, 9, 0}), (Ids{d[0]})) << "block {9,9,9,9} after another parent";
  EXPECT_EQ(parentless.match({1, 2, 3, 4, 9, 9, 9, 9, 0}), (Ids{b[0], b[1]}));

  const std::string error = what([&] { parentless.set_hash_for_testing(&constantHash); });
  EXPECT_NE(error.find("got 3 cached blocks, expected none"), std::string::npos) << error;
}

TEST(BlockPoolTest, OrphanLeftByAnEvictedParentGivesWayWhenItsHashComesAgain) {
  // A and B start together with one prompt: A registers the blocks first,
  // B's are duplicates (uncached) and its last full block hangs under A's.
  BlockPool pool(8, 2, /*prefix_caching=*/true);
  const Ids prompt{1, 1, 2, 2, 3};
  Ids a = pool.hold_prefix(prompt), b = pool.hold_prefix(prompt);
  for (int i = 0; i < 3; ++i) a.push_back(pool.take());
  for (int i = 0; i < 3; ++i) b.push_back(pool.take());
  pool.commit(a, prompt, 4);
  pool.commit(b, prompt, 4);
  EXPECT_EQ(pool.stats().cached_blocks, 2);
  EXPECT_FALSE(pool.is_cached(b[0]));
  EXPECT_FALSE(pool.is_cached(b[1]));
  // B decodes: its block {3, 7} hangs under A's {1, 1}{2, 2}.
  Ids b_tokens = cat(prompt, {7});
  pool.commit(b, b_tokens, 6);
  EXPECT_TRUE(pool.is_cached(b[2]));
  EXPECT_EQ(pool.match(cat(b_tokens, {0})), (Ids{a[0], a[1], b[2]}));
  // A leaves and its blocks are evicted (tail first): B's block is an orphan.
  pool.give_back(a);
  Ids filler = takeN(pool, 5);
  EXPECT_EQ(filler, (Ids{2, 6, 7, 1, 0})) << "A's partial block, the two never used, then A's two evicted";
  EXPECT_EQ(pool.stats().evictions, 2);
  EXPECT_TRUE(pool.is_cached(b[2]));
  EXPECT_TRUE(pool.match(cat(b_tokens, {0})).empty());
  // B leaves, D computes the same tokens: D's blocks are registered, the
  // orphan gives way.
  const int64_t orphan = b[2];
  pool.give_back(b);
  pool.give_back(filler);
  EXPECT_EQ(pool.free(), 8);
  Ids d = admitAndPrefill(pool, cat(b_tokens, {0}));
  EXPECT_FALSE(pool.is_cached(orphan));
  EXPECT_EQ(pool.stats().cached_blocks, 3);
  EXPECT_EQ(pool.match(cat(b_tokens, {0})), Ids(d.begin(), d.begin() + 3));
}

TEST(BlockPoolTest, MisuseIsNamed) {
  BlockPool pool(4, 2, /*prefix_caching=*/true);
  Ids none{3};
  std::string error = what([&] { pool.give_back(none); });
  EXPECT_NE(error.find("BlockPool::give_back for block 3: got a block no one holds"), std::string::npos) << error;
  error = what([&] { pool.hold({2}); });
  EXPECT_NE(error.find("BlockPool::hold for block 2: got a free block"), std::string::npos) << error;
  error = what([&] { pool.hold({4}); });
  EXPECT_NE(error.find("got a block outside the pool, expected one in [0, 4)"), std::string::npos) << error;
  const Ids table{pool.take()};
  error = what([&] { pool.commit(table, {1, 2, 3}, 3); });
  EXPECT_NE(error.find("got 3 tokens cached, expected 0 to min(3, 2)"), std::string::npos) << error;
  error = what([&] { BlockPool(4, 0, /*prefix_caching=*/true); });
  EXPECT_NE(error.find("dtp::inference: BlockPool for 4 blocks of 0 tokens"), std::string::npos) << error;

  // A refused hold holds nothing.
  BlockPool cached(4, 2, /*prefix_caching=*/true);
  Ids a = admitAndPrefill(cached, {1, 2, 3});
  const int64_t full = a[0], partial = a[1];
  cached.give_back(a);
  error = what([&] { cached.hold({full, partial}); });
  EXPECT_NE(error.find("BlockPool::hold for block " + std::to_string(partial) + ": got a free block"),
            std::string::npos) << error;
  EXPECT_EQ(cached.refcount(full), 0);
  EXPECT_EQ(cached.free(), 4);
}

// The obvious prefix cache: every lookup scans the pool; a block's content
// is its whole token prefix; the evictable order is a release clock.
class ReferencePool {
 public:
  ReferencePool(int64_t n, int64_t bs) : bs_(bs), blocks_(n) {
    for (int64_t b = n - 1; b >= 0; --b) free_.push_back(b);
  }
  int64_t free() const {
    int64_t n = static_cast<int64_t>(free_.size());
    for (const Blk& b : blocks_) n += b.cached && b.ref == 0;
    return n;
  }
  int64_t cached() const {
    int64_t n = 0;
    for (const Blk& b : blocks_) n += b.cached;
    return n;
  }
  int64_t take() {
    int64_t id = -1;
    if (!free_.empty()) {
      id = free_.back();
      free_.pop_back();
    } else {
      for (int64_t b = 0; b < static_cast<int64_t>(blocks_.size()); ++b) {
        if (blocks_[b].cached && blocks_[b].ref == 0 && (id < 0 || blocks_[b].released < blocks_[id].released)) id = b;
      }
      if (id < 0) throw std::runtime_error("reference: nothing to take");
      ++evictions;
    }
    blocks_[id] = Blk();
    blocks_[id].ref = 1;
    return id;
  }
  void give_back(Ids& table) {
    for (auto it = table.rbegin(); it != table.rend(); ++it) {
      Blk& b = blocks_[*it];
      if (--b.ref > 0) continue;
      if (b.cached) {
        b.released = ++clock_;
      } else {
        free_.push_back(*it);
      }
    }
    table.clear();
  }
  Ids match(const Ids& tokens) const {
    Ids hit;
    uint64_t parent = 0;
    for (int64_t i = 0; tokens.size() > 0 && i < (static_cast<int64_t>(tokens.size()) - 1) / bs_; ++i) {
      const int64_t id = find(parent, prefix(tokens, i));
      if (id < 0) break;
      hit.push_back(id);
      parent = blocks_[id].kid;
    }
    return hit;
  }
  Ids hold_prefix(const Ids& tokens) {
    Ids hit = match(tokens);
    for (int64_t id : hit) ++blocks_[id].ref;
    queries += static_cast<int64_t>(tokens.size());
    hits += static_cast<int64_t>(hit.size()) * bs_;
    return hit;
  }
  void commit(const Ids& table, const Ids& tokens, int64_t cached) {
    bool known = true;
    uint64_t parent = 0;
    for (int64_t i = 0; i < cached / bs_; ++i) {
      Blk& b = blocks_[table[i]];
      if (b.seen || b.cached) {
        known = b.known && live(b.kid);
        parent = b.kid;
        continue;
      }
      b.seen = true;
      if (!known) continue;
      const Ids p = prefix(tokens, i);
      const int64_t same = find(parent, p);
      if (same >= 0) {
        b.known = true;
        b.kid = blocks_[same].kid;
        parent = b.kid;
        continue;
      }
      for (int64_t o = 0; o < static_cast<int64_t>(blocks_.size()); ++o) {
        if (!blocks_[o].cached || blocks_[o].prefix != p) continue;
        if (live(blocks_[o].parent)) throw std::runtime_error("reference: two live blocks of one prefix");
        blocks_[o].cached = false;  // the orphan
        if (blocks_[o].ref == 0) free_.push_back(o);
      }
      b.cached = b.known = true;
      b.kid = ++kids_;
      b.parent = parent;
      b.prefix = p;
      parent = b.kid;
    }
  }
  int64_t refcount(int64_t id) const { return blocks_[id].ref; }
  bool is_cached(int64_t id) const { return blocks_[id].cached; }

  int64_t queries = 0, hits = 0, evictions = 0;

 private:
  struct Blk {
    int64_t ref = 0;
    bool cached = false, seen = false, known = false;
    uint64_t kid = 0, parent = 0;
    Ids prefix;  // cached: tokens [0, end of this block)
    int64_t released = 0;
  };
  Ids prefix(const Ids& tokens, int64_t i) const { return Ids(tokens.begin(), tokens.begin() + (i + 1) * bs_); }
  bool live(uint64_t kid) const {
    if (kid == 0) return true;
    for (const Blk& b : blocks_) {
      if (b.cached && b.kid == kid) return true;
    }
    return false;
  }
  int64_t find(uint64_t parent, const Ids& p) const {
    for (int64_t b = 0; b < static_cast<int64_t>(blocks_.size()); ++b) {
      if (blocks_[b].cached && blocks_[b].parent == parent && blocks_[b].prefix == p) return b;
    }
    return -1;
  }

  int64_t bs_;
  std::vector<Blk> blocks_;
  Ids free_;
  int64_t clock_ = 0;
  uint64_t kids_ = 0;
};

// A serving run in miniature: requests from a few shared prompts with
// short random suffixes over a small vocabulary (so equal blocks come under
// different parents), some asked again, admitted, prefilled in chunks,
// decoding mostly greedily (a prompt asked twice at once computes the same
// blocks twice), preempted when blocks run out, finishing; `check` runs
// after every operation.
struct Sequence {
  Ids tokens, table;
  int64_t cached = 0;
};

template <class Pool, class Check>
void serveAtRandom(Pool& pool, int64_t block_size, uint64_t seed, int operations, Check check) {
  std::mt19937_64 rng(seed);
  auto below = [&](int64_t n) { return static_cast<int64_t>(rng() % static_cast<uint64_t>(n)); };
  std::vector<Ids> bases(3);
  for (Ids& base : bases) {
    for (int i = 0; i < 12 * block_size; ++i) base.push_back(below(3));
  }
  std::vector<Ids> asked;  // the last prompts, some asked again
  std::vector<Sequence> running;
  auto blocksFor = [&](int64_t tokens) { return (tokens + block_size - 1) / block_size; };
  for (int op = 0; op < operations && !::testing::Test::HasFailure(); ++op) {
    const int64_t kind = below(10);
    if (kind < 3 && running.size() < 6) {  // admit
      Ids tokens;
      int copies = 1;
      if (!asked.empty() && below(3) == 0) {
        tokens = asked[below(static_cast<int64_t>(asked.size()))];  // asked again, maybe twice at once
        copies += static_cast<int>(below(2));
      } else {
        const Ids& base = bases[below(3)];
        tokens.assign(base.begin(), base.begin() + below(static_cast<int64_t>(base.size()) + 1));
        for (int64_t n = 1 + below(3 * block_size); n > 0; --n) tokens.push_back(below(2));
        asked.push_back(tokens);
        if (asked.size() > 8) asked.erase(asked.begin());
      }
      for (; copies > 0; --copies) {
        Sequence s;
        s.tokens = tokens;
        s.table = pool.hold_prefix(s.tokens);
        s.cached = static_cast<int64_t>(s.table.size()) * block_size;
        const int64_t need = blocksFor(static_cast<int64_t>(s.tokens.size())) - static_cast<int64_t>(s.table.size());
        if (need > pool.free()) {
          pool.give_back(s.table);  // does not fit: not admitted
        } else {
          for (int64_t i = 0; i < need; ++i) s.table.push_back(pool.take());
          running.push_back(std::move(s));
        }
      }
    } else if (kind < 8 && !running.empty()) {  // one step of one row
      const size_t r = static_cast<size_t>(below(static_cast<int64_t>(running.size())));
      Sequence& s = running[r];
      if (s.cached < static_cast<int64_t>(s.tokens.size())) {
        s.cached += 1 + below(static_cast<int64_t>(s.tokens.size()) - s.cached);
      } else {
        // Mostly greedy: the same prompt goes on the same way.
        const int64_t n = static_cast<int64_t>(s.tokens.size());
        s.tokens.push_back(below(4) == 0 ? below(2) : (s.tokens[n - 1] + 2 * s.tokens[n - 2 + (n < 2)]) % 3);
        if (blocksFor(static_cast<int64_t>(s.tokens.size())) > static_cast<int64_t>(s.table.size())) {
          if (pool.free() == 0) {  // preempted
            pool.give_back(s.table);
            running.erase(running.begin() + static_cast<std::ptrdiff_t>(r));
            check(op);
            continue;
          }
          s.table.push_back(pool.take());
        }
        s.cached = static_cast<int64_t>(s.tokens.size());
      }
      pool.commit(s.table, s.tokens, s.cached);
    } else if (!running.empty()) {  // finishes
      const size_t r = static_cast<size_t>(below(static_cast<int64_t>(running.size())));
      pool.give_back(running[r].table);
      running.erase(running.begin() + static_cast<std::ptrdiff_t>(r));
    }
    check(op);
  }
}

// Runs the same calls on both pools and compares every answer.
struct Both {
  BlockPool fast;
  ReferencePool ref;
  int64_t takes = 0, evictions_seen = 0;
  Both(int64_t n, int64_t bs) : fast(n, bs, /*prefix_caching=*/true), ref(n, bs) {}
  int64_t free() const {
    EXPECT_EQ(fast.free(), ref.free());
    return fast.free();
  }
  int64_t take() {
    const int64_t a = fast.take(), b = ref.take();
    EXPECT_EQ(a, b) << "take " << takes;
    ++takes;
    return a;
  }
  void give_back(Ids& table) {
    Ids copy = table;
    fast.give_back(table);
    ref.give_back(copy);
  }
  Ids hold_prefix(const Ids& tokens) {
    const Ids a = fast.hold_prefix(tokens), b = ref.hold_prefix(tokens);
    EXPECT_EQ(a, b);
    return a;
  }
  void commit(const Ids& table, const Ids& tokens, int64_t cached) {
    fast.commit(table, tokens, cached);
    ref.commit(table, tokens, cached);
  }
};

TEST(BlockPoolTest, AgreesWithAReferenceThatScansThePoolOverThousandsOfOperations) {
  for (uint64_t seed : {1u, 2u, 3u, 4u}) {
    Both pools(24, 4);
    int64_t hits_seen = 0;
    serveAtRandom(pools, 4, seed, 10000, [&](int op) {
      ASSERT_EQ(pools.fast.free(), pools.ref.free()) << "seed " << seed << " op " << op;
      ASSERT_EQ(pools.fast.stats().cached_blocks, pools.ref.cached()) << "seed " << seed << " op " << op;
      ASSERT_EQ(pools.fast.stats().queries, pools.ref.queries);
      ASSERT_EQ(pools.fast.stats().hits, pools.ref.hits) << "seed " << seed << " op " << op;
      ASSERT_EQ(pools.fast.stats().evictions, pools.ref.evictions) << "seed " << seed << " op " << op;
      for (int64_t b = 0; b < 24; ++b) {
        ASSERT_EQ(pools.fast.refcount(b), pools.ref.refcount(b)) << "block " << b << " seed " << seed << " op " << op;
        ASSERT_EQ(pools.fast.is_cached(b), pools.ref.is_cached(b)) << "block " << b << " seed " << seed << " op " << op;
      }
      hits_seen = pools.fast.stats().hits;
    });
    ASSERT_FALSE(::testing::Test::HasFailure()) << "seed " << seed;
    // The run must exercise what it checks.
    EXPECT_GT(hits_seen, 1000) << "seed " << seed;
    EXPECT_GT(pools.fast.stats().evictions, 100) << "seed " << seed;
  }
}

// Any hash, however weak: every block hold_prefix hands out holds exactly
// the prompt's tokens up to its end (the driver knows what each forward
// wrote where).
TEST(BlockPoolTest, WeakHashesNeverHandOutWrongBlocksOverThousandsOfOperations) {
  struct Weak {
    static uint64_t hash(uint64_t parent, const int64_t* t, int64_t n) {
      uint64_t h = parent * 31;
      for (int64_t i = 0; i < n; ++i) h += static_cast<uint64_t>(t[i]);
      return h % 5;
    }
  };
  for (BlockHashFn fn : {&Weak::hash, &constantHash, &tokensOnlyHash, &BlockPool::chain_hash}) {
    struct Watched {
      BlockPool pool;
      std::vector<Ids> written;  // per block: the prefix whose last block it holds (empty: not full)
      int64_t checked = 0;
      Watched() : pool(24, 4, /*prefix_caching=*/true), written(24) {}
      int64_t free() const { return pool.free(); }
      int64_t take() {
        const int64_t b = pool.take();
        written[b].clear();
        return b;
      }
      void give_back(Ids& t) { pool.give_back(t); }
      Ids hold_prefix(const Ids& tokens) {
        const Ids hit = pool.hold_prefix(tokens);
        for (size_t i = 0; i < hit.size(); ++i) {
          EXPECT_EQ(written[hit[i]], Ids(tokens.begin(), tokens.begin() + 4 * (i + 1))) << "block " << hit[i];
          ++checked;
        }
        return hit;
      }
      void commit(const Ids& table, const Ids& tokens, int64_t cached) {
        for (int64_t i = 0; i < cached / 4; ++i) {
          if (written[table[i]].empty()) written[table[i]].assign(tokens.begin(), tokens.begin() + 4 * (i + 1));
        }
        pool.commit(table, tokens, cached);
      }
    } w;
    w.pool.set_hash_for_testing(fn);
    serveAtRandom(w, 4, 7, 6000, [&](int op) {
      int64_t unheld = 0;
      for (int64_t b = 0; b < 24; ++b) unheld += w.pool.refcount(b) == 0;
      ASSERT_EQ(w.pool.free(), unheld) << "op " << op << ": free() counts the blocks no one holds";
    });
    EXPECT_GT(w.checked, 300) << "hits to check";
  }
}

}  // namespace
}  // namespace dtp::inference
