#pragma once

#include "dcp/pieces.h"
#include "dtp/process_group.h"

#include <optional>

namespace dtp::dcp {

// Collective: writes `plan` (every rank's) as the checkpoint folder `dir`.
void write_plan(SavePlan plan, const std::string& dir, const std::optional<ProcessGroup>& group);

}  // namespace dtp::dcp
