// CommCounter (alias CommDebugMode): counts the collectives this thread
// issues while it is alive, the C++ counterpart of PyTorch's CommDebugMode.
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
//
// Collectives are also tallied by the hooked module (DTP_MODULE, with an FQN
// from parallelize_module) whose forward issued them, and by the ATen op
// whose sharding propagation did ("" for explicit calls: redistribute, a
// style's layouts). CommDebugMode adds the backward: while one is alive,
// hooked modules mark where their backward starts and ends (NOTE: [Module
// tracking] in src/nn/module_tracker.cpp), at the cost of two identity
// autograd nodes per module call. The backward of the autograd engine's own
// thread (CPU) is attributed, that of device threads (CUDA) is not.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace dtp {

enum class CollectiveType : uint8_t {
  AllReduce, AllGather, ReduceScatter, AllToAll, Broadcast, Scatter, Barrier, Send, Recv
};
constexpr size_t kNumCollectiveTypes = 9;
const char* to_string(CollectiveType type);

enum class Pass : uint8_t { Forward, Backward };
const char* to_string(Pass pass);

// The collectives of one kind issued in one place.
struct CommRecord {
  std::string module;  // FQN, "" outside any hooked module
  Pass pass;
  std::string op;      // e.g. "aten::mm", "" for explicit calls
  CollectiveType type;
  int64_t count = 0, bytes = 0;
};

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
  // "" outside any hooked module), then per collective; both passes, or one.
  std::map<std::string, std::map<std::string, int64_t>> per_module() const;
  std::map<std::string, std::map<std::string, int64_t>> per_module(Pass pass) const;
  // The tallies by module, pass, op and collective, in that order.
  std::vector<CommRecord> records() const;
  void reset();
  // e.g. "all_reduce: 2 (64 B), all_gather: 1 (32 B)"
  std::string str() const;
  // {"total": {...}, "modules": {"<fqn>": {"forward": {"all_reduce": {"count":
  // n, "bytes": b, "ops": {"aten::mm": n}}}, "backward": {...}}}}
  std::string to_json() const;
  // PyTorch's generate_comm_debug_tracing_table: the module tree, then per
  // pass the ops, then their collectives with counts and bytes.
  std::string tracing_table() const;

  // Called by the communication layer for every collective.
  static void record(CollectiveType type, int64_t bytes, const std::vector<int>& group_ranks);
  // The FQN that forward collectives are attributed to, on this thread.
  static void set_current_module(const std::string* fqn);
  static const std::string* current_module();
  // The op whose propagation runs (name and overload), on this thread.
  static void set_current_op(const std::string* name, const std::string* overload);
  static std::pair<const std::string*, const std::string*> current_op();
  // Whether a CommDebugMode is alive on this thread (modules then mark
  // their backward).
  static bool tracking_modules();
  // The module whose backward runs on this thread: entered when the
  // gradient of its output arrives, left when its inputs' gradients leave.
  static void enter_backward(int64_t token, const std::string& fqn);
  static void leave_backward(int64_t token);

 private:
  static size_t idx(CollectiveType t) { return static_cast<size_t>(t); }
  std::array<int64_t, kNumCollectiveTypes> counts_{};
  std::array<int64_t, kNumCollectiveTypes> bytes_{};
  using Place = std::tuple<std::string, Pass, std::string, CollectiveType>;  // module, pass, op, type
  std::map<Place, std::pair<int64_t, int64_t>> places_;                    // count, bytes

 protected:
  struct TrackModules {};
  explicit CommCounter(TrackModules);
  bool tracks_modules_ = false;
  struct Tally {
    std::array<int64_t, kNumCollectiveTypes> counts{}, bytes{};
  };
  std::map<std::vector<int>, Tally> per_group_;
};

// Files the collectives of this scope (on this thread) under `fqn`, then
// restores the previous name: hooked modules' forwards, gradient reduction.
class CommModuleScope {
 public:
  explicit CommModuleScope(const std::string* fqn) : prev_(CommCounter::current_module()) {
    CommCounter::set_current_module(fqn);
  }
  ~CommModuleScope() { CommCounter::set_current_module(prev_); }
  CommModuleScope(const CommModuleScope&) = delete;
  CommModuleScope& operator=(const CommModuleScope&) = delete;

 private:
  const std::string* prev_;
};

// A CommCounter that also attributes backward collectives to modules (the
// counterpart of PyTorch's CommDebugMode): for debugging, not for every step.
class CommDebugMode : public CommCounter {
 public:
  CommDebugMode() : CommCounter(TrackModules{}) {}
};

}  // namespace dtp
