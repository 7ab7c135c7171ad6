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

}  // namespace dtp
