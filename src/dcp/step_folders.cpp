#include "dtp/dcp/step_folders.h"

#include "dcp/pieces.h"
#include "dtp/dcp/checkpoint.h"
#include "io/staged_dir.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <filesystem>

namespace dtp::dcp {
namespace {

namespace fs = std::filesystem;

// N of "step-<N>" (and of "step-<N>.incomplete" with `incomplete`), else -1.
int64_t stepOf(const std::string& name, bool incomplete) {
  const std::string suffix = incomplete ? ".incomplete" : "";
  if (name.rfind("step-", 0) != 0 || name.size() <= 5 + suffix.size() ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return -1;
  }
  const std::string digits = name.substr(5, name.size() - 5 - suffix.size());
  if (digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), ::isdigit)) return -1;
  return std::stoll(digits);
}

struct Step {
  int64_t step;
  std::string path;
  bool incomplete;
};

// The step folders of `dir`, newest first (at one step, the unfinished save
// before the complete folder: it was the later attempt).
std::vector<Step> stepsOf(const std::string& dir) {
  std::vector<Step> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (!it->is_directory(ec)) continue;
    const std::string name = it->path().filename().string();
    for (bool incomplete : {false, true}) {
      const int64_t step = stepOf(name, incomplete);
      if (step >= 0) out.push_back({step, it->path().string(), incomplete});
    }
  }
  std::sort(out.begin(), out.end(), [](const Step& a, const Step& b) {
    return a.step != b.step ? a.step > b.step : a.incomplete > b.incomplete;
  });
  return out;
}

}  // namespace

std::string step_folder(const std::string& dir, int64_t step) {
  TORCH_CHECK(step >= 0, "step_folder: step ", step, " is negative.");
  std::string base = dir;
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  return base + "/step-" + std::to_string(step);
}

FoundCheckpoint find_checkpoint(const std::string& dir) {
  std::error_code ec;
  // A checkpoint itself, or not a folder (read_index names what is wrong:
  // missing, an unfinished save, a single file).
  if (!fs::is_directory(dir, ec) || fs::exists(fs::path(dir) / io::CheckpointIndex::kFileName, ec)) {
    return {dir, {}, read_index(dir).metadata};
  }
  FoundCheckpoint found;
  for (const Step& s : stepsOf(dir)) {
    if (s.incomplete) {
      found.skipped.push_back("skipping '" + s.path + "': a save that did not finish");
      continue;
    }
    try {
      found.metadata = read_index(s.path).metadata;
      found.path = s.path;
      return found;
    } catch (const c10::Error& e) {
      found.skipped.push_back("skipping '" + s.path + "': " + e.what_without_backtrace());
    }
  }
  std::string why;
  for (const auto& line : found.skipped) why += "\n  " + line;
  TORCH_CHECK(false, "load: '", dir, "' holds no complete checkpoint: no index.json and no readable step-<N>/ "
              "folder", why.empty() ? std::string(".") : ":" + why,
              "\nPass a folder written by dtp-train --save (or dcp::save), or one of its step-<N> folders.");
}

std::vector<std::string> remove_old_steps(const std::string& dir, int64_t keep) {
  TORCH_CHECK(keep >= 1, "remove_old_steps: keep must be at least 1, got ", keep, ".");
  std::vector<std::string> removed;
  int64_t complete = 0;
  for (const Step& s : stepsOf(dir)) {
    // A killed save older than a complete step: dtp's, and no save holds it.
    if (s.incomplete) {
      if (complete > 0 && io::remove_stale_staging(s.path, is_checkpoint_entry)) removed.push_back(s.path);
      continue;
    }
    try {
      read_index(s.path);
    } catch (const c10::Error&) {
      continue;  // not a checkpoint that dtp recognises: not ours to remove
    }
    if (++complete <= keep) continue;
    const auto left = io::remove_owned(s.path, is_checkpoint_entry);
    if (left.empty()) {
      removed.push_back(s.path);
    } else {
      TORCH_WARN("remove_old_steps: kept '", s.path, "': it holds entries dtp did not write (", left.front(),
                 left.size() > 1 ? c10::str(" and ", left.size() - 1, " more") : std::string(), ").");
    }
  }
  return removed;
}

}  // namespace dtp::dcp
