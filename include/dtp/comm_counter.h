// CommCounter: counts the collectives this thread issues while it is alive,
// the C++ counterpart of PyTorch's CommDebugMode.
//
//   dtp::CommCounter comm;
//   y = x.redistribute(mesh, {Replicate()});
//   EXPECT_EQ(comm.count(CollectiveType::AllGather), 1);
//
// Counters nest: every counter alive on the thread sees every collective.
// A collective over a one-rank group moves nothing and is not counted.
// Bytes are the payload of this rank: the tensor reduced (all_reduce), the
// gathered output (all_gather), the input (reduce_scatter, all_to_all,
// scatter on src) or the tensor broadcast.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dtp {

enum class CollectiveType : uint8_t {
  AllReduce, AllGather, ReduceScatter, AllToAll, Broadcast, Scatter, Barrier
};
constexpr size_t kNumCollectiveTypes = 7;
const char* to_string(CollectiveType type);

class CommCounter {
 public:
  CommCounter();
  ~CommCounter();
  CommCounter(const CommCounter&) = delete;
  CommCounter& operator=(const CommCounter&) = delete;

  int64_t count(CollectiveType type) const { return counts_[idx(type)]; }
  int64_t bytes(CollectiveType type) const { return bytes_[idx(type)]; }
  // The same, for the collectives of the group of these global ranks
  // (ProcessGroup::global_ranks(), e.g. mesh.get_group("dp")).
  int64_t count(CollectiveType type, const std::vector<int>& group_ranks) const;
  int64_t bytes(CollectiveType type, const std::vector<int>& group_ranks) const;
  int64_t total_count() const;
  int64_t total_bytes() const;
  // Counts per module FQN (the module whose forward or backward was running,
  // "" outside any hooked module), then per collective.
  const std::map<std::string, std::map<std::string, int64_t>>& per_module() const {
    return per_module_;
  }
  void reset();
  // e.g. "all_reduce: 2 (64 B), all_gather: 1 (32 B)"
  std::string str() const;

  // Called by the communication layer for every collective.
  static void record(CollectiveType type, int64_t bytes, const std::vector<int>& group_ranks);
  // The FQN that per_module() attributes collectives to, on this thread.
  static void set_current_module(const std::string* fqn);
  static const std::string* current_module();

 private:
  static size_t idx(CollectiveType t) { return static_cast<size_t>(t); }
  std::array<int64_t, kNumCollectiveTypes> counts_{};
  std::array<int64_t, kNumCollectiveTypes> bytes_{};
  std::map<std::string, std::map<std::string, int64_t>> per_module_;
  struct Tally {
    std::array<int64_t, kNumCollectiveTypes> counts{}, bytes{};
  };
  std::map<std::vector<int>, Tally> per_group_;
};

}  // namespace dtp
