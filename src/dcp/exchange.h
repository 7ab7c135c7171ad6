// What checkpoint ranks tell each other: "did anyone fail?" agreements, so
// that a rank's error reaches every rank instead of leaving the others
// waiting (small strings travel through comm/agree.h).
#pragma once

#include "comm/agree.h"
#include "comm/error_text.h"
#include "dtp/process_group.h"

#include <optional>
#include <string>
#include <vector>

namespace dtp::dcp {

// The group `requested`, else the thread's default group, else none (one
// process alone).
std::optional<ProcessGroup> checkpoint_group(const std::optional<ProcessGroup>& requested);

// Collective: when any rank's `error` is non-empty, every rank throws one
// error listing each failed rank's text, prefixed by `what`.
void agree(const std::optional<ProcessGroup>& group, const std::string& error, const std::string& what);

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
