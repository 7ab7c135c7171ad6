// NOTE: [Nothing dtp did not write] A save writes into "<dir>.incomplete"
// and only then puts its files in place. It never removes or replaces an
// entry it did not write:
// - the target folder must be absent, empty, or hold only entries the writer
//   recognises as its own (Owns); anything else is an error naming the path
//   and a few foreign entries, raised before anything is created;
// - a stale "<dir>.incomplete" is cleared only when it carries dtp's marker
//   (.dtp-writing) and holds only the writer's entries;
// - the staging folder is made under a name of its own with its marker
//   flock'ed, then renamed into place without replacing; the marker stays
//   locked until the files are in place, so a second save to the same folder
//   (an AsyncSaver still writing it, another job) is refused by name and
//   never takes a live staging folder for a stale one;
// - what replaced entries leave behind is removed entry by entry, by name,
//   never with remove_all.
// See NOTE: [Atomic checkpoint folders] in include/dtp/dcp/checkpoint.h.
#pragma once

#include <string>
#include <vector>

namespace dtp::io {

// The entry names (no path) one writer creates in its folders.
using Owns = bool (*)(const std::string& name);

// "<dir>.incomplete": where a save writes until it commits.
std::string incomplete_dir(const std::string& dir);

// The entries of `dir` that `owns` does not recognise (folders never are),
// sorted; empty for a missing or empty folder.
std::vector<std::string> foreign_entries(const std::string& dir, Owns owns);

// Unlinks the entries of `dir` that `owns` recognises (by name, one by one),
// then `dir` when that left it empty. Returns the entries left.
std::vector<std::string> remove_owned(const std::string& dir, Owns owns);

// Removes the staging folder `staging` (a "<dir>.incomplete") when it is a
// stale one of ours: every entry ours and no live save holding its marker.
// True when it is gone.
bool remove_stale_staging(const std::string& staging, Owns owns);

class StagedDir {
 public:
  enum class Mode {
    kReplace,  // the folder becomes the new one (a checkpoint): an atomic exchange
    kMerge,    // the new files join the folder's other entries (a Hugging Face export)
  };
  // Checks `dir` (kReplace: see the NOTE; kMerge: absent or a folder), clears
  // a stale incomplete folder of ours and creates a fresh one, locked.
  // `api` prefixes errors ("save", "save_hf").
  StagedDir(std::string dir, Owns owns, Mode mode, std::string api);
  // Not committed: removes what was staged (our entries only).
  ~StagedDir();
  StagedDir(const StagedDir&) = delete;
  StagedDir& operator=(const StagedDir&) = delete;

  // kReplace: renames the staging folder to `dir` (an atomic exchange with an
  // earlier checkpoint, whose entries are then removed by name). kMerge:
  // renames each staged entry into `dir` (replacing same-named entries, which
  // `owns` must recognise), then removes the entries of `dir` that `owns`
  // recognises and this save did not write (stale shards), when
  // `stale(name)` says so.
  void commit(Owns stale = nullptr);

 private:
  std::string dir_, staging_, api_;
  Owns owns_;
  Mode mode_;
  int lock_fd_ = -1;
  bool committed_ = false;
};

}  // namespace dtp::io
