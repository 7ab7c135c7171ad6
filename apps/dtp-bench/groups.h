// The benches' extra groups over all ranks: made with DTP_SHM and
// DTP_SHM_MAX_BYTES set as given (a group reads them when it is made), e.g.
// Gloo alone ("0") beside the default, or shared memory with larger slots.
#pragma once

#include "dtp/process_group.h"

#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dtp::bench {

// The variables are restored afterwards.
inline ProcessGroup whole_group_with(const ProcessGroup& world, const char* shm, const std::string& max_bytes = "") {
  std::vector<std::pair<const char*, std::optional<std::string>>> saved;
  for (const char* name : {"DTP_SHM", "DTP_SHM_MAX_BYTES"}) {
    const char* v = std::getenv(name);
    saved.emplace_back(name, v ? std::optional<std::string>(v) : std::nullopt);
  }
  setenv("DTP_SHM", shm, 1);
  setenv("DTP_SHM_MAX_BYTES", max_bytes.c_str(), 1);
  std::vector<int> all(world.size());
  for (int r = 0; r < world.size(); ++r) all[r] = r;
  ProcessGroup g = world.new_group(all);
  for (const auto& [name, value] : saved) value ? setenv(name, value->c_str(), 1) : unsetenv(name);
  return g;
}

}  // namespace dtp::bench
