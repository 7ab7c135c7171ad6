#pragma once

#include "dtp/dcp/checkpoint.h"

#include <optional>

namespace dtp::dcp {

// load() with the folder's index already read (by load_state, which needs
// it first to know which optimizer state to create), so it is read once.
std::map<std::string, std::string> load_with_index(StateDict& state_dict, const std::string& dir,
                                                   std::optional<io::CheckpointIndex> index, const LoadOptions& options);

}  // namespace dtp::dcp
