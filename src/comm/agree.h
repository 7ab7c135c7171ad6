// Small strings exchanged among a group's ranks, and the check that ranks
// passed the same arguments to a one-time collective API.
#pragma once

#include "dtp/process_group.h"

#include <optional>
#include <string>
#include <vector>

namespace dtp {

// Every rank's `mine`, in group-rank order (just {mine} without a group).
// Two all_gathers (lengths, bytes).
std::vector<std::string> all_gather_strings(const std::optional<ProcessGroup>& group, const std::string& mine);

// NOTE: [Ranks agree on arguments] A one-time collective API (save, load,
// export, generate, pipeline set-up) first checks that every rank passed the
// same value of each argument that must match: ranks that disagree would
// otherwise pass the collectives that follow and leave wrong state (a folder
// half written, replicas that differ, a stall). Collective: throws on every
// rank an error naming `api`, `argument` and each rank's value (120 bytes of
// it around the first difference). One all_gather_strings; never on a
// per-op path.
void agree_on_value(const std::optional<ProcessGroup>& group, const std::string& api, const std::string& argument,
                    const std::string& value);

// NOTE: [A collective API names its first collective] A rank that calls a
// collective API (dcp::save, say) while its peers never do waits in the
// API's first collective until it fails, and that failure named only "all_gather
// #3", not the call the peers missed. While a CollectiveCaller is alive on a
// thread, a failed collective of that thread is reported as `api`'s, with
// `must`: what every rank of the group must do (by default, call `api` too).
// agree_on_value sets one, so every one-time API that starts by agreeing on
// its arguments (save, load, export, generate, pipeline set-up) names
// itself. Scoped, nestable (the innermost names), thread-local; costs two
// pointer writes.
class CollectiveCaller {
 public:
  explicit CollectiveCaller(const std::string& api, std::string must = "");
  ~CollectiveCaller();
  CollectiveCaller(const CollectiveCaller&) = delete;
  CollectiveCaller& operator=(const CollectiveCaller&) = delete;
  // The innermost live caller of this thread, or null.
  static const CollectiveCaller* current();
  const std::string& api() const { return api_; }
  const std::string& must() const { return must_; }

 private:
  std::string api_, must_;
  const CollectiveCaller* prev_;
};

}  // namespace dtp
