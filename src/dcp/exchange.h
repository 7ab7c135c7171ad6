// What checkpoint ranks tell each other: small strings (piece lists, error
// texts) gathered on every rank, and "did anyone fail?" agreements, so that
// a rank's error reaches every rank instead of leaving the others waiting.
#pragma once

#include "comm/error_text.h"
#include "dtp/process_group.h"

#include <optional>
#include <string>
#include <vector>

namespace dtp::dcp {

// The group `requested`, else the thread's default group, else none (one
// process alone).
std::optional<ProcessGroup> checkpoint_group(const std::optional<ProcessGroup>& requested);

// Every rank's `mine`, in group-rank order (just {mine} without a group).
std::vector<std::string> all_gather_strings(const std::optional<ProcessGroup>& group, const std::string& mine);

// Collective: when any rank's `error` is non-empty, every rank throws one
// error listing each failed rank's text, prefixed by `what`.
void agree(const std::optional<ProcessGroup>& group, const std::string& error, const std::string& what);

// NOTE: [Ranks agree on arguments] A one-time collective API (save, load,
// export, generate, pipeline set-up) first checks that every rank passed the
// same value of each argument that must match: ranks that disagree would
// otherwise pass the collectives that follow and leave wrong state (a folder
// half written, replicas that differ). Collective: throws on every rank an
// error naming `api`, `argument` and each rank's value (120 bytes of it
// around the first difference). One small all_gather; never on a per-op
// path.
void agree_on_value(const std::optional<ProcessGroup>& group, const std::string& api, const std::string& argument,
                    const std::string& value);

// Runs `f`, returning its error text ("" when it succeeded).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return error_text(e);
  }
  return "";
}

}  // namespace dtp::dcp
