#include "dtp/comm_counter.h"

#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

namespace dtp {
namespace {
// Per thread, so that W ranks can run as W threads of one test process.
thread_local std::vector<CommCounter*> active_counters;
thread_local int tracking_counters = 0;
thread_local const std::string* active_module = nullptr;
thread_local const std::string* active_op = nullptr;
thread_local const std::string* active_overload = nullptr;
// The modules whose backward runs, innermost last. An entry of another graph
// task (a module whose inputs needed no gradient never leaves) is stale.
struct BackwardModule {
  int64_t token;
  std::string fqn;
  const void* task;
};
thread_local std::vector<BackwardModule> backward_modules;

const void* currentTask() { return torch::autograd::get_current_graph_task_exec_info(); }

std::string opName() {
  if (active_op == nullptr) return "";
  return active_overload == nullptr || active_overload->empty() ? *active_op : *active_op + "." + *active_overload;
}

std::string jsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}
}  // namespace

const char* to_string(Pass pass) { return pass == Pass::Forward ? "forward" : "backward"; }

const char* to_string(CollectiveType type) {
  switch (type) {
    case CollectiveType::AllReduce: return "all_reduce";
    case CollectiveType::AllGather: return "all_gather";
    case CollectiveType::ReduceScatter: return "reduce_scatter";
    case CollectiveType::AllToAll: return "all_to_all";
    case CollectiveType::Broadcast: return "broadcast";
    case CollectiveType::Scatter: return "scatter";
    case CollectiveType::Barrier: return "barrier";
    case CollectiveType::Send: return "send";
    case CollectiveType::Recv: return "recv";
  }
  return "?";
}

CommCounter::CommCounter() { active_counters.push_back(this); }

CommCounter::CommCounter(TrackModules) : tracks_modules_(true) {
  active_counters.push_back(this);
  ++tracking_counters;
}

CommCounter::~CommCounter() {
  if (tracks_modules_) --tracking_counters;
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
  places_.clear();
  per_group_.clear();
}

std::vector<CommRecord> CommCounter::records() const {
  std::vector<CommRecord> out;
  for (const auto& [place, tally] : places_)
    out.push_back({std::get<0>(place), std::get<1>(place), std::get<2>(place), std::get<3>(place), tally.first,
                   tally.second});
  return out;
}

std::map<std::string, std::map<std::string, int64_t>> CommCounter::per_module() const {
  std::map<std::string, std::map<std::string, int64_t>> out;
  for (const CommRecord& r : records()) out[r.module][to_string(r.type)] += r.count;
  return out;
}

std::map<std::string, std::map<std::string, int64_t>> CommCounter::per_module(Pass pass) const {
  std::map<std::string, std::map<std::string, int64_t>> out;
  for (const CommRecord& r : records())
    if (r.pass == pass) out[r.module][to_string(r.type)] += r.count;
  return out;
}

std::string CommCounter::to_json() const {
  // module -> pass -> collective -> (count, bytes, op -> count)
  struct Entry {
    int64_t count = 0, bytes = 0;
    std::map<std::string, int64_t> ops;
  };
  std::map<std::string, std::map<std::string, std::map<std::string, Entry>>> tree;
  for (const CommRecord& r : records()) {
    Entry& x = tree[r.module][to_string(r.pass)][to_string(r.type)];
    x.count += r.count;
    x.bytes += r.bytes;
    x.ops[r.op] += r.count;
  }
  std::ostringstream os;
  os << "{\"total\": {\"count\": " << total_count() << ", \"bytes\": " << total_bytes() << "}, \"modules\": {";
  bool first_module = true;
  for (const auto& [module, passes] : tree) {
    os << (first_module ? "" : ", ") << jsonString(module) << ": {";
    first_module = false;
    bool first_pass = true;
    for (const auto& [pass, types] : passes) {
      os << (first_pass ? "" : ", ") << jsonString(pass) << ": {";
      first_pass = false;
      bool first_type = true;
      for (const auto& [type, x] : types) {
        os << (first_type ? "" : ", ") << jsonString(type) << ": {\"count\": " << x.count << ", \"bytes\": " << x.bytes
           << ", \"ops\": {";
        first_type = false;
        bool first_op = true;
        for (const auto& [op, n] : x.ops) {
          os << (first_op ? "" : ", ") << jsonString(op) << ": " << n;
          first_op = false;
        }
        os << "}}";
      }
      os << "}";
    }
    os << "}";
  }
  os << "}}";
  return os.str();
}

std::string CommCounter::tracing_table() const {
  // Modules in FQN order, each with its parents listed first ("" is Global).
  const std::vector<CommRecord> all = records();
  std::set<std::string> modules{""};
  for (const CommRecord& r : all) {
    for (size_t dot = r.module.find('.'); dot != std::string::npos; dot = r.module.find('.', dot + 1))
      modules.insert(r.module.substr(0, dot));
    modules.insert(r.module);
  }
  std::ostringstream os;
  for (const std::string& module : modules) {
    const int depth = module.empty() ? 0 : 1 + static_cast<int>(std::count(module.begin(), module.end(), '.'));
    const std::string pad(2 * depth, ' ');
    os << pad << (module.empty() ? "Global" : "Module: " + module) << "\n";
    for (Pass pass : {Pass::Forward, Pass::Backward}) {
      // op -> collective -> (count, bytes), for this module and pass only.
      std::map<std::string, std::map<std::string, std::pair<int64_t, int64_t>>> ops;
      for (const CommRecord& r : all) {
        if (r.module != module || r.pass != pass) continue;
        auto& x = ops[r.op.empty() ? "(explicit)" : r.op][to_string(r.type)];
        x.first += r.count;
        x.second += r.bytes;
      }
      if (ops.empty()) continue;
      os << pad << "  " << (pass == Pass::Forward ? "FORWARD PASS" : "BACKWARD PASS") << "\n";
      for (const auto& [op, types] : ops) {
        os << pad << "    **" << op << "\n";
        for (const auto& [type, x] : types)
          os << pad << "      *" << type << ": " << x.first << " (" << x.second << " B)\n";
      }
    }
  }
  return os.str();
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
  if (active_counters.empty()) return;
  // In the autograd engine's backward (a graph task runs on this thread),
  // the module is the innermost whose backward was entered, or one whose
  // forward runs again inside it (activation checkpointing's recomputation).
  const void* task = currentTask();
  while (!backward_modules.empty() && backward_modules.back().task != task) backward_modules.pop_back();
  const bool backward = task != nullptr;
  std::string module = active_module != nullptr ? *active_module
                       : backward && !backward_modules.empty() ? backward_modules.back().fqn
                                                               : std::string();
  const Place place{std::move(module), backward ? Pass::Backward : Pass::Forward, opName(), type};
  for (CommCounter* c : active_counters) {
    c->counts_[idx(type)] += 1;
    c->bytes_[idx(type)] += bytes;
    Tally& g = c->per_group_[group_ranks];
    g.counts[idx(type)] += 1;
    g.bytes[idx(type)] += bytes;
    auto& tally = c->places_[place];
    tally.first += 1;
    tally.second += bytes;
  }
}

void CommCounter::set_current_module(const std::string* fqn) { active_module = fqn; }
const std::string* CommCounter::current_module() { return active_module; }
void CommCounter::set_current_op(const std::string* name, const std::string* overload) {
  active_op = name;
  active_overload = overload;
}
std::pair<const std::string*, const std::string*> CommCounter::current_op() { return {active_op, active_overload}; }
bool CommCounter::tracking_modules() { return tracking_counters > 0; }

void CommCounter::enter_backward(int64_t token, const std::string& fqn) {
  // A module with several outputs enters once, through whichever output's
  // backward runs first (NOTE: [Module tracking]).
  for (const auto& m : backward_modules)
    if (m.token == token) return;
  backward_modules.push_back({token, fqn, currentTask()});
}

void CommCounter::leave_backward(int64_t token) {
  for (auto it = backward_modules.rbegin(); it != backward_modules.rend(); ++it) {
    if (it->token == token) {
      backward_modules.erase(std::next(it).base());
      return;
    }
  }
}

}  // namespace dtp
