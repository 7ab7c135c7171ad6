// dtp-bench's timings: one rep on every rank, and the summary of reps.
#pragma once

#include "dtensor/sharding_prop.h"
#include "dtp/process_group.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace dtp::bench {

// The middle value (the upper one of an even count); 0 for none.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Milliseconds `f` took on the slowest rank, all ranks starting together.
inline double timed_max(const ProcessGroup& world, const std::function<void()>& f) {
  world.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  f();
  at::Tensor ms = at::full({1}, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(),
                           at::kDouble);
  world.all_reduce(ms, ReduceOp::Max);
  return ms.item<double>();
}

// Counts the ATen ops that reach dtp's DTensor fallback on this thread while
// alive: each asks the sharding propagator once (linear and matmul without
// autograd are one op there, NOTE: [Fused ops without autograd]). The ops the
// fallback runs on local shards are plain: not counted.
class DTensorOpCounter {
 public:
  int64_t ops() const { return calls() - start_; }

 private:
  static int64_t calls() {
    const PropagationCacheStats s = propagation_cache_stats();
    return s.hits + s.misses;
  }
  int64_t start_ = calls();
};

}  // namespace dtp::bench
