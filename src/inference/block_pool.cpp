#include "block_pool.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace dtp::inference {
namespace {

uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

uint64_t BlockPool::chain_hash(uint64_t parent, const int64_t* tokens, int64_t n) {
  uint64_t h = splitmix64(parent ^ static_cast<uint64_t>(n));
  for (int64_t i = 0; i < n; ++i) h = splitmix64(h ^ static_cast<uint64_t>(tokens[i]));
  return h;
}

BlockPool::BlockPool(int64_t num_blocks, int64_t block_size, bool prefix_caching)
    : total_(num_blocks), block_size_(block_size), caching_(prefix_caching) {
  TORCH_CHECK(num_blocks >= 0 && block_size > 0, "dtp::inference: BlockPool for ", num_blocks, " blocks of ",
              block_size, " tokens: got a negative count or a block size below 1, expected num_blocks >= 0 and "
              "block_size >= 1. Size the cache from the memory left and --block-size.");
  blocks_.resize(num_blocks);
  free_.reserve(num_blocks);
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);  // block 0 first
  if (caching_) {
    tokens_.resize(num_blocks * block_size);
    by_hash_.reserve(num_blocks);
  }
}

void BlockPool::checkBlock(int64_t block, const char* api) const {
  TORCH_CHECK(block >= 0 && block < total_, "dtp::inference: BlockPool::", api, " for block ", block,
              ": got a block outside the pool, expected one in [0, ", total_, "). Pass block ids from take() or "
              "match().");
}

int64_t BlockPool::refcount(int64_t block) const {
  checkBlock(block, "refcount");
  return blocks_[block].ref;
}

bool BlockPool::is_cached(int64_t block) const {
  checkBlock(block, "is_cached");
  return blocks_[block].cached;
}

bool BlockPool::live(int64_t owner, uint64_t kid) const {
  return owner < 0 ? kid == 0 : blocks_[owner].cached && blocks_[owner].kid == kid;
}

void BlockPool::unlink(int64_t block) {
  Block& b = blocks_[block];
  (b.prev < 0 ? head_ : blocks_[b.prev].next) = b.next;
  (b.next < 0 ? tail_ : blocks_[b.next].prev) = b.prev;
  b.prev = b.next = -1;
  --evictable_;
}

// Drops a block's registration; one no one holds moves from the evictable
// list to the free stack.
void BlockPool::uncache(int64_t block) {
  Block& b = blocks_[block];
  TORCH_INTERNAL_ASSERT(b.cached);
  by_hash_.erase(b.hash);
  b.cached = false;
  --stats_.cached_blocks;
  if (b.ref == 0) {
    unlink(block);
    free_.push_back(block);
  }
}

int64_t BlockPool::take() {
  int64_t block;
  if (!free_.empty()) {
    block = free_.back();
    free_.pop_back();
  } else {
    TORCH_CHECK(head_ >= 0, "dtp::inference: BlockPool::take for a new KV block: got all ", total_, " blocks held, "
                "expected at least one free or evictable. The scheduler must preempt before it plans past free() "
                "(and ranks must run the same build).");
    block = head_;
    unlink(block);
    by_hash_.erase(blocks_[block].hash);
    --stats_.cached_blocks;
    ++stats_.evictions;
  }
  Block& b = blocks_[block];
  b = Block();
  b.ref = 1;
  return block;
}

void BlockPool::give_back(std::vector<int64_t>& blocks) {
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    checkBlock(*it, "give_back");
    Block& b = blocks_[*it];
    TORCH_CHECK(b.ref > 0, "dtp::inference: BlockPool::give_back for block ", *it, ": got a block no one holds, "
                "expected one from take() or hold(). Give each table back once.");
    if (--b.ref > 0) continue;
    if (!b.cached) {
      free_.push_back(*it);
      continue;
    }
    b.prev = tail_;
    b.next = -1;
    (tail_ < 0 ? head_ : blocks_[tail_].next) = *it;
    tail_ = *it;
    ++evictable_;
  }
  blocks.clear();
}

std::vector<int64_t> BlockPool::match(const std::vector<int64_t>& tokens) const {
  std::vector<int64_t> hit;
  if (!caching_ || tokens.empty()) return hit;
  // See NOTE: [Prefix cache]: the last token is always computed.
  const int64_t most = (static_cast<int64_t>(tokens.size()) - 1) / block_size_;
  uint64_t parent_hash = kRootHash, parent_kid = 0;
  for (int64_t i = 0; i < most; ++i) {
    const int64_t* t = tokens.data() + i * block_size_;
    auto it = by_hash_.find(hash_(parent_hash, t, block_size_));
    if (it == by_hash_.end()) break;
    const Block& b = blocks_[it->second];
    // A hash only names a candidate; its parent and tokens decide.
    if (b.parent_kid != parent_kid || !std::equal(t, t + block_size_, tokensOf(it->second))) break;
    hit.push_back(it->second);
    parent_hash = b.hash;
    parent_kid = b.kid;
  }
  return hit;
}

void BlockPool::hold(const std::vector<int64_t>& blocks) {
  for (int64_t block : blocks) {
    checkBlock(block, "hold");
    TORCH_CHECK(blocks_[block].ref > 0 || blocks_[block].cached, "dtp::inference: BlockPool::hold for block ", block,
                ": got a free block, expected a cached one from match() or one held already. Take new blocks with "
                "take().");
  }
  for (int64_t block : blocks) {
    Block& b = blocks_[block];
    if (b.ref++ == 0) unlink(block);
  }
}

std::vector<int64_t> BlockPool::hold_prefix(const std::vector<int64_t>& tokens) {
  std::vector<int64_t> hit = match(tokens);
  hold(hit);
  if (caching_) {
    stats_.queries += static_cast<int64_t>(tokens.size());
    stats_.hits += static_cast<int64_t>(hit.size()) * block_size_;
  }
  return hit;
}

void BlockPool::commit(const std::vector<int64_t>& table, const std::vector<int64_t>& tokens, int64_t cached) {
  const int64_t n = static_cast<int64_t>(table.size());
  TORCH_CHECK(cached >= 0 && cached <= static_cast<int64_t>(tokens.size()) && cached <= n * block_size_,
              "dtp::inference: BlockPool::commit for a sequence of ", tokens.size(), " tokens in ", n, " blocks: got ",
              cached, " tokens cached, expected 0 to min(", tokens.size(), ", ", n * block_size_,
              "). Commit the row's tokens and table after its forward.");
  if (!caching_) return;
  const int64_t full = cached / block_size_;
  // The blocks examined before form a prefix of the table: walk back from
  // the last full one to it, so that a call costs the blocks it fills.
  int64_t i = full;
  for (; i > 0; --i) {
    checkBlock(table[i - 1], "commit");
    const Block& b = blocks_[table[i - 1]];
    TORCH_CHECK(b.ref > 0, "dtp::inference: BlockPool::commit for block ", table[i - 1], " at index ", i - 1,
                " of a table: got a block no one holds, expected the sequence's own. Commit before give_back.");
    if (b.seen || b.cached) break;
  }
  uint64_t parent_hash = kRootHash, parent_kid = 0;
  int64_t parent_owner = -1;
  bool known = true;
  if (i > 0) {
    const Block& p = blocks_[table[i - 1]];
    known = p.known && live(p.owner, p.kid);
    parent_hash = p.hash;
    parent_kid = p.kid;
    parent_owner = p.owner;
  }
  for (; i < full; ++i) {
    const int64_t id = table[i];
    Block& b = blocks_[id];
    b.seen = true;
    if (!known) continue;  // after an unregistered parent: see NOTE: [Prefix cache]
    const int64_t* t = tokens.data() + i * block_size_;
    const uint64_t h = hash_(parent_hash, t, block_size_);
    auto it = by_hash_.find(h);
    if (it != by_hash_.end()) {
      const int64_t other = it->second;
      const Block& o = blocks_[other];
      if (o.parent_kid == parent_kid && std::equal(t, t + block_size_, tokensOf(other))) {
        // Cached under another id: this block stays uncached, its content is the other's.
        b.known = true;
        b.hash = h;
        b.kid = o.kid;
        b.owner = other;
        parent_hash = h;
        parent_kid = o.kid;
        parent_owner = other;
        continue;
      }
      if (live(o.parent_owner, o.parent_kid)) {
        known = false;  // a collision with a reachable block: the first keeps the hash
        continue;
      }
      uncache(other);  // an orphan no match reaches gives way
    }
    b.cached = b.known = true;
    b.hash = h;
    b.kid = ++next_kid_;
    b.owner = id;
    b.parent_kid = parent_kid;
    b.parent_owner = parent_owner;
    std::copy(t, t + block_size_, tokens_.begin() + id * block_size_);
    by_hash_.emplace(h, id);
    ++stats_.cached_blocks;
    parent_hash = h;
    parent_kid = b.kid;
    parent_owner = id;
  }
}

void BlockPool::set_hash_for_testing(BlockHashFn fn) {
  TORCH_CHECK(fn != nullptr && by_hash_.empty(), "dtp::inference: BlockPool::set_hash_for_testing: got ",
              by_hash_.size(), " cached blocks, expected none and a function. Set it before the first commit.");
  hash_ = fn;
}

}  // namespace dtp::inference
