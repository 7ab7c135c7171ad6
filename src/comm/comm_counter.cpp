#include "dtp/comm_counter.h"

#include <algorithm>
#include <sstream>
#include <vector>

namespace dtp {
namespace {
// Per thread, so that W ranks can run as W threads of one test process.
thread_local std::vector<CommCounter*> active_counters;
thread_local const std::string* active_module = nullptr;
}  // namespace

const char* to_string(CollectiveType type) {
  switch (type) {
    case CollectiveType::AllReduce: return "all_reduce";
    case CollectiveType::AllGather: return "all_gather";
    case CollectiveType::ReduceScatter: return "reduce_scatter";
    case CollectiveType::AllToAll: return "all_to_all";
    case CollectiveType::Broadcast: return "broadcast";
    case CollectiveType::Scatter: return "scatter";
    case CollectiveType::Barrier: return "barrier";
  }
  return "?";
}

CommCounter::CommCounter() { active_counters.push_back(this); }

CommCounter::~CommCounter() {
  active_counters.erase(
      std::remove(active_counters.begin(), active_counters.end(), this),
      active_counters.end());
}

int64_t CommCounter::total_count() const {
  int64_t n = 0;
  for (auto c : counts_) n += c;
  return n;
}

int64_t CommCounter::total_bytes() const {
  int64_t n = 0;
  for (auto b : bytes_) n += b;
  return n;
}

int64_t CommCounter::count(CollectiveType type, const std::vector<int>& group_ranks) const {
  auto it = per_group_.find(group_ranks);
  return it == per_group_.end() ? 0 : it->second.counts[idx(type)];
}

int64_t CommCounter::bytes(CollectiveType type, const std::vector<int>& group_ranks) const {
  auto it = per_group_.find(group_ranks);
  return it == per_group_.end() ? 0 : it->second.bytes[idx(type)];
}

void CommCounter::reset() {
  counts_.fill(0);
  bytes_.fill(0);
  per_module_.clear();
  per_group_.clear();
}

std::string CommCounter::str() const {
  std::ostringstream os;
  bool first = true;
  for (size_t i = 0; i < kNumCollectiveTypes; ++i) {
    if (counts_[i] == 0) continue;
    os << (first ? "" : ", ") << to_string(static_cast<CollectiveType>(i)) << ": "
       << counts_[i] << " (" << bytes_[i] << " B)";
    first = false;
  }
  return first ? "no collectives" : os.str();
}

void CommCounter::record(CollectiveType type, int64_t bytes, const std::vector<int>& group_ranks) {
  for (CommCounter* c : active_counters) {
    c->counts_[idx(type)] += 1;
    c->bytes_[idx(type)] += bytes;
    Tally& g = c->per_group_[group_ranks];
    g.counts[idx(type)] += 1;
    g.bytes[idx(type)] += bytes;
    c->per_module_[active_module ? *active_module : ""][to_string(type)] += 1;
  }
}

void CommCounter::set_current_module(const std::string* fqn) { active_module = fqn; }
const std::string* CommCounter::current_module() { return active_module; }

}  // namespace dtp
