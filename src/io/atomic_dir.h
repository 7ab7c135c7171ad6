// See NOTE: [Atomic checkpoint folders] in include/dtp/dcp/checkpoint.h.
#pragma once

#include <string>

namespace dtp::io {

// "<dir>.incomplete": where a save writes until it commits.
std::string incomplete_dir(const std::string& dir);
// Removes a stale incomplete folder of `dir` and creates an empty one (and
// the parents of `dir`).
void prepare_incomplete_dir(const std::string& dir);
// fsyncs the incomplete folder, then renames it to `dir` atomically (an
// exchange with an existing `dir`, whose old contents are then removed).
void commit_dir(const std::string& dir);

}  // namespace dtp::io
