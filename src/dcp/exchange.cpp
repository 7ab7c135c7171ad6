#include "dcp/exchange.h"

namespace dtp::dcp {

std::optional<ProcessGroup> checkpoint_group(const std::optional<ProcessGroup>& requested) {
  if (requested) return requested;
  if (is_initialized()) return default_process_group();
  return std::nullopt;
}

void agree(const std::optional<ProcessGroup>& group, const std::string& error, const std::string& what) {
  const auto errors = all_gather_strings(group, error);
  std::string text;
  int failed = 0;
  for (size_t r = 0; r < errors.size(); ++r) {
    if (errors[r].empty()) continue;
    ++failed;
    text += (errors.size() > 1 ? "\n  rank " + std::to_string(r) + ": " : std::string(" ")) + errors[r];
  }
  TORCH_CHECK(failed == 0, what, " failed", errors.size() > 1 ? " on " + std::to_string(failed) + " rank(s):" : ":",
              text);
}

}  // namespace dtp::dcp
