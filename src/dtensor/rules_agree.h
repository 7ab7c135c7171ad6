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
// threads), and a miss of the decision cache cannot either (ranks miss it
// at different calls). So:
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
//  - An op with a user rule that ranks call directly, with no set-up API in
//    between, is checked at its first dispatch on each mesh, per rank
//    (check_user_rule_agrees, from the DTensor fallback once the call's
//    placements are decided and before any communication): the op's own
//    text, hashed, over each mesh dimension (one all_gather of 8 bytes per
//    rank and dimension); once per (op, mesh) and thread, then nothing but a
//    lookup. The first dispatch of an op on a mesh is the same call on every
//    rank of an SPMD program, unlike a cache miss.
// Not seen: two registrations of one lambda with different captures (give
// them different `version`s), rules registered after the last of those
// entries, and a rule a rank changes after the op's first dispatch. A rank
// that has no user rule for the op runs no first-dispatch check: the ranks
// that have one then fail in it, the error naming the op and the missing
// rule (NOTE: [A collective API names its first collective]), unless a
// set-up API ran first and named the difference.
void check_sharding_rules_agree(const DeviceMesh& mesh, const char* api);

// Whether register_sharding gave `op` ("ns::name" or "ns::name.overload", as
// op_name() prints it) a rule in this process. Takes a lock: call it once
// per op (the dispatcher caches it).
bool has_user_rule(const std::string& op);

// The first-dispatch check of one op's user rule over each dimension of
// `mesh` (above). Collective; throws on every rank naming the op and each
// rank's rule when they differ.
void check_user_rule_agrees(const DeviceMesh& mesh, const std::string& op);

// Called by register_sharding once the rule is in the registry.
void record_user_rule(const std::string& op, std::string description);
// The fingerprint and the text it hashes ("op\trule\n" lines, sorted).
uint64_t user_rules_fingerprint();
std::string user_rules_listing();

}  // namespace dtp
