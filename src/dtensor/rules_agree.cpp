// See NOTE: [Ranks agree on sharding rules] in rules_agree.h.
#include "dtensor/rules_agree.h"

#include "comm/agree.h"

#include <ATen/ATen.h>

#include <map>
#include <mutex>
#include <set>
#include <sstream>

namespace dtp {
namespace {

struct UserRules {
  std::mutex mu;
  std::map<std::string, std::string> by_op;  // op -> what was registered
  uint64_t fingerprint = 0;
  std::string listing;
};

UserRules& userRules() {
  static UserRules* r = new UserRules();
  return *r;
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// "op\trule" lines back into a map.
std::map<std::string, std::string> parseListing(const std::string& listing) {
  std::map<std::string, std::string> out;
  std::istringstream in(listing);
  std::string line;
  while (std::getline(in, line)) {
    const auto tab = line.find('\t');
    if (tab != std::string::npos) out[line.substr(0, tab)] = line.substr(tab + 1);
  }
  return out;
}

void checkOverGroup(const ProcessGroup& group, const char* api) {
  if (!group.valid() || group.size() <= 1) return;
  const int64_t w = group.size();
  const at::Tensor mine = at::full({1}, static_cast<int64_t>(user_rules_fingerprint()), at::kLong);
  const at::Tensor all = group.all_gather(mine, 0, std::vector<int64_t>(w, 1)).wait().contiguous();
  const int64_t* fp = all.data_ptr<int64_t>();
  bool same = true;
  for (int64_t r = 1; r < w; ++r) same &= fp[r] == fp[0];
  if (same) return;
  // Every rank saw the same fingerprints, so every rank takes this exchange.
  const auto listings = all_gather_strings(group, user_rules_listing());
  std::vector<std::map<std::string, std::string>> rules;
  std::set<std::string> ops;
  for (const auto& l : listings) {
    rules.push_back(parseListing(l));
    for (const auto& [op, rule] : rules.back()) ops.insert(op);
  }
  std::string each;
  int shown = 0, differ = 0;
  for (const auto& op : ops) {
    bool op_same = true;
    for (int64_t r = 1; r < w; ++r) op_same &= rules[r].count(op) == rules[0].count(op) &&
                                               (!rules[0].count(op) || rules[r].at(op) == rules[0].at(op));
    if (op_same) continue;
    ++differ;
    if (++shown > 8) continue;
    each += "\n  " + op + ":";
    for (int64_t r = 0; r < w; ++r) {
      auto it = rules[r].find(op);
      each += "\n    global rank " + std::to_string(group.global_ranks()[r]) + ": " +
              (it == rules[r].end() ? std::string("none registered (dtp's own rule, if any)") : it->second);
    }
  }
  if (differ > 8) each += "\n  ... and " + std::to_string(differ - 8) + " more ops";
  TORCH_CHECK(false, api, ": the ranks registered different sharding rules (dtp::register_sharding) for ", differ,
              " op", differ == 1 ? "" : "s", ":", each, "\nEvery rank must register the same rule for each op "
              "(the same function or strategies, and the same RegisterShardingOptions::version) before ", api,
              ": ranks that shard an op differently compute wrong values or stall.");
}

// One op's rule over `group`: its text hashed, then, only when the hashes
// differ, the texts, named per rank.
void checkOpOverGroup(const ProcessGroup& group, const DeviceMesh& mesh, const std::string& op) {
  if (!group.valid() || group.size() <= 1) return;
  const int64_t w = group.size();
  std::string rule;
  {
    UserRules& u = userRules();
    std::lock_guard<std::mutex> lock(u.mu);
    auto it = u.by_op.find(op);
    rule = it == u.by_op.end() ? std::string() : it->second;
  }
  const std::string where = "first dispatch on " + mesh.str();
  std::vector<std::string> rules;
  {
    // NOTE: [A collective API names its first collective]
    const CollectiveCaller caller(
        "the sharding-rule check (NOTE: [Ranks agree on sharding rules]) at " + op + "'s " + where,
        "every rank registers the same rule for " + op + " (dtp::register_sharding) and calls " + op +
            " on this mesh; a rank that has no user rule for it runs no check");
    const at::Tensor mine = at::full({1}, static_cast<int64_t>(fnv1a(rule) >> 1), at::kLong);
    const at::Tensor all = group.all_gather(mine, 0, std::vector<int64_t>(w, 1)).wait().contiguous();
    const int64_t* fp = all.data_ptr<int64_t>();
    bool same = true;
    for (int64_t r = 1; r < w; ++r) same &= fp[r] == fp[0];
    if (same) return;
    rules = all_gather_strings(group, rule);  // every rank saw the same hashes
  }
  std::string each;
  for (int64_t r = 0; r < w; ++r)
    each += "\n    global rank " + std::to_string(group.global_ranks()[r]) + ": " +
            (rules[r].empty() ? std::string("none registered (dtp's own rule, if any)") : rules[r]);
  TORCH_CHECK(false, "dtp: ", op, ": the ranks registered different sharding rules (dtp::register_sharding) for ", op,
              ", found at its ", where, ":", each, "\nEvery rank must register the same rule for ", op,
              " (the same function or strategies, and the same RegisterShardingOptions::version) before calling it: "
              "ranks that shard an op differently compute wrong values or stall.");
}

}  // namespace

bool has_user_rule(const std::string& op) {
  UserRules& u = userRules();
  std::lock_guard<std::mutex> lock(u.mu);
  return u.by_op.count(op) > 0;
}

void check_user_rule_agrees(const DeviceMesh& mesh, const std::string& op) {
  if (!mesh.valid()) return;
  for (int64_t d = 0; d < mesh.ndim(); ++d) checkOpOverGroup(mesh.get_group(d), mesh, op);
}

void record_user_rule(const std::string& op, std::string description) {
  UserRules& u = userRules();
  std::lock_guard<std::mutex> lock(u.mu);
  u.by_op[op] = std::move(description);
  std::string listing;
  for (const auto& [name, rule] : u.by_op) listing += name + "\t" + rule + "\n";
  u.fingerprint = fnv1a(listing);
  u.listing = std::move(listing);
}

uint64_t user_rules_fingerprint() {
  UserRules& u = userRules();
  std::lock_guard<std::mutex> lock(u.mu);
  return u.fingerprint;
}

std::string user_rules_listing() {
  UserRules& u = userRules();
  std::lock_guard<std::mutex> lock(u.mu);
  return u.listing;
}

void check_sharding_rules_agree(const DeviceMesh& mesh, const char* api) {
  if (!mesh.valid()) return;
  for (int64_t d = 0; d < mesh.ndim(); ++d) checkOverGroup(mesh.get_group(d), api);
}

}  // namespace dtp
