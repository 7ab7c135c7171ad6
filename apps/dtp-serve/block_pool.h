// The KV blocks of dtp-serve's paged cache (NOTE: [Paged KV cache] in
// include/dtp/models/kv_cache.h): which are free. Every rank runs the same
// allocations in the same order, so every rank's block tables are the same
// (NOTE: [Serving step] in engine.h).
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

namespace dtp::serve {

class BlockPool {
 public:
  explicit BlockPool(int64_t num_blocks) : total_(num_blocks) {
    for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);  // block 0 first
  }
  int64_t total() const { return total_; }
  int64_t free() const { return static_cast<int64_t>(free_.size()); }
  int64_t used() const { return total_ - free(); }
  // One free block; the caller checked free() first.
  int64_t take() {
    TORCH_CHECK(!free_.empty(), "dtp-serve: a step needs a KV block, but all ", total_, " are held: got a plan "
                "that overcommits the cache, expected rank 0 to preempt first. Ranks must run the same build.");
    const int64_t b = free_.back();
    free_.pop_back();
    return b;
  }
  void give_back(std::vector<int64_t>& blocks) {
    for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) free_.push_back(*it);
    blocks.clear();
  }

 private:
  int64_t total_;
  std::vector<int64_t> free_;  // a stack: the last freed is the next taken
};

}  // namespace dtp::serve
