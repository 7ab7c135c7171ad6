// Checkpoint folders as torchtitan keeps them: one folder per saved step
// inside the folder the user names.
//
//   ck/step-100/            a checkpoint (index.json, rank-*.safetensors)
//   ck/step-200/
//   ck/step-300.incomplete/ a save that did not finish (a killed job)
//   ck/notes.txt            the user's: never touched
//
// dtp removes only its own older step folders (remove_old_steps), and inside
// them only the entries it wrote (NOTE: [Nothing dtp did not write] in
// src/io/staged_dir.h). None of these functions is collective.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dtp::dcp {

// "<dir>/step-<step>".
std::string step_folder(const std::string& dir, int64_t step);

struct FoundCheckpoint {
  std::string path;                            // the checkpoint folder to load
  std::vector<std::string> skipped;            // one line per newer folder passed over, and why
  std::map<std::string, std::string> metadata;  // its index's (read and checked once here)
};

// The checkpoint `dir` names: `dir` itself when it holds index.json (a step
// folder, or a checkpoint of the older flat layout), else its newest complete
// step-<N>/: a half-written "step-<N>.incomplete" or a step folder whose
// index does not read is skipped and said in `skipped`. A folder with no
// complete checkpoint, or a `dir` whose own index does not read, is an
// error naming it and what it holds.
FoundCheckpoint find_checkpoint(const std::string& dir);

// Removes the complete step-<N> folders of `dir` older than its newest
// `keep` (>= 1), each entry by name, only the checkpoint's own; a step folder
// holding anything else keeps those entries (and a warning names them). Also
// removes a "step-<N>.incomplete" older than the newest complete step when it
// is dtp's and no save holds it (a killed save). Returns the removed folders.
// Call it on one rank.
std::vector<std::string> remove_old_steps(const std::string& dir, int64_t keep);

}  // namespace dtp::dcp
