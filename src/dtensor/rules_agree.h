// Checks that the ranks registered the same sharding rules, at the one-time
// collective entries every rank of a mesh calls.
#pragma once

#include "dtp/device_mesh.h"

#include <cstdint>
#include <string>

namespace dtp {

// NOTE: [Ranks agree on sharding rules] dtp::register_sharding changes how
// an op is sharded in this process only. Ranks with different rules for one
// op pick different placements for the same call and then compute wrong
// values or stall in mismatched collectives, without a word. Registration
// itself cannot check (a collective there would hang the usual pattern:
// rules registered once per process, or by one thread when ranks are
// threads), and the first dispatch of the op cannot either (ranks miss the
// decision cache at different calls). So:
//  - register_sharding records, per op, a text of what it registered:
//    `strategies [S(0) -> S(0)] [R -> R]` for a fixed list, `function <the
//    callable's type>` for a lambda or functor (every lambda has its own
//    type, the same in every process of one binary), `function <symbol or
//    file+offset>` for a function pointer, plus the shape function's type
//    and the user's RegisterShardingOptions::version label. The registry's
//    fingerprint is a 64-bit hash of those texts, sorted by op, updated at
//    registration; nothing is added to the per-op path.
//  - The one-time collective set-up APIs (parallelize_module,
//    distribute_module, fully_shard, replicate) exchange the fingerprint
//    over each dimension of their mesh: one all_gather of 8 bytes per rank
//    per mesh dimension. Only when fingerprints differ do the ranks
//    exchange the texts, and every rank throws an error naming each op whose
//    rules differ and each rank's rule.
// Not seen: two registrations of one lambda with different captures (give
// them different `version`s), and rules registered after the last of those
// entries.
void check_sharding_rules_agree(const DeviceMesh& mesh, const char* api);

// Called by register_sharding once the rule is in the registry.
void record_user_rule(const std::string& op, std::string description);
// The fingerprint and the text it hashes ("op\trule\n" lines, sorted).
uint64_t user_rules_fingerprint();
std::string user_rules_listing();

}  // namespace dtp
