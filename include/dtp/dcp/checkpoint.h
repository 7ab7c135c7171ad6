// Sharded checkpoints, as PyTorch's Distributed Checkpoint (DCP): every rank
// writes the shards it owns, one rank writes the index, and a load reshards
// onto whatever mesh and placements the receiving state dict has.
//
//   auto sd = dcp::get_model_state_dict(*model);
//   dcp::save(sd, "ck/step-100");         // collective
//   dcp::load(sd, "ck/step-100");         // collective; fills sd in place
//
// NOTE: [Sharded checkpoint layout] A checkpoint is a folder:
//   index.json                 io::CheckpointIndex: every global tensor and its pieces
//   rank-00003.safetensors     the pieces rank 3 wrote, each under its FQN
// - A DTensor's piece is the writer's local shard (offsets from its mesh
//   coordinate; uneven and empty shards as torch.chunk). Over mesh dims where
//   it is Replicate only coordinate 0 writes, so each byte is written once by
//   the lowest rank holding it. Partial tensors are refused (reduce first).
// - A plain tensor is taken as replicated over the job: global rank 0 writes it.
// - Nothing is gathered: each rank writes from its own shard's memory.
// - Loading reads, for each local shard, only the byte ranges of the pieces
//   that overlap it (NOTE: [Bounded box IO]).
//
// NOTE: [Atomic checkpoint folders] Ranks write into "<dir>.incomplete",
// fsync every file; rank 0 writes index.json last, fsyncs, then renames the
// folder to <dir> (an atomic exchange with a previous <dir> of dtp's, whose
// files are then removed by name). A crash at any point leaves the previous
// <dir> whole; what was half written stays in "<dir>.incomplete", which load
// refuses by name and the next save clears; a save that fails cleanly
// removes it. <dir> must be absent, empty or dtp's own checkpoint: see
// NOTE: [Nothing dtp did not write] in src/io/staged_dir.h. Every rank
// passes the same <dir> (checked). dtp-train keeps one folder per step,
// include/dtp/dcp/step_folders.h.
#pragma once

#include "dtp/dcp/state_dict.h"
#include "dtp/io/checkpoint_index.h"
#include "dtp/process_group.h"

#include <torch/optim/optimizer.h>

#include <future>
#include <memory>
#include <optional>
#include <string>

namespace dtp::dcp {

struct SaveOptions {
  // The ranks that take part; default: the thread's default group (or this
  // process alone when there is none).
  std::optional<ProcessGroup> group;
};

struct LoadOptions {
  std::optional<ProcessGroup> group;
  // Bytes a rank holds at once while reading (NOTE: [Bounded box IO]).
  uint64_t buffer_bytes = uint64_t{16} << 20;
  // Check each piece's CRC-32 before anything is changed; the pieces are
  // shared round-robin among the ranks, so each reads about 1/W of the
  // checkpoint once more.
  bool verify_checksums = true;
  // Checkpoint tensors the state dict does not ask for are an error unless
  // they start with one of these prefixes (e.g. "optimizer." when loading a
  // model alone).
  std::vector<std::string> ignore_prefixes;
};

// Collective: every rank of the group calls it with its state dict (the same
// names on every rank). Errors on any rank reach every rank.
void save(const StateDict& state_dict, const std::string& dir, const SaveOptions& options = {});

// Collective. Fills every tensor of `state_dict` in place from `dir`, whatever
// the layout it was saved with; returns the checkpoint's metadata. Names
// missing from the checkpoint, shapes or dtypes that differ, a truncated file
// or a failed checksum are errors naming them, raised before any tensor is
// changed.
std::map<std::string, std::string> load(StateDict& state_dict, const std::string& dir,
                                        const LoadOptions& options = {});

// The index of a complete checkpoint folder (its tensor names, shapes and
// metadata), read by this process alone.
io::CheckpointIndex read_index(const std::string& dir);

// Saves in the background, as DCP's async_save: save() copies this rank's
// pieces to host memory, returns, and a thread writes them and commits the
// folder (over a process group of its own, so it never interleaves with the
// training's collectives). The next save(), wait() and the destructor wait
// for the previous one; an error in the background is thrown by the next
// save() or wait(), never lost. Constructing it is collective.
class AsyncSaver {
 public:
  explicit AsyncSaver(std::optional<ProcessGroup> group = std::nullopt);
  ~AsyncSaver();
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;

  void save(const StateDict& state_dict, const std::string& dir);
  // Blocks until the last save is committed; rethrows its error.
  void wait();
  // True while this rank's writer is busy. Ranks may see it change at
  // different moments: never make collectives depend on it.
  bool in_flight() const;

 private:
  std::optional<ProcessGroup> group_;
  std::future<void> pending_;
};

// Module + optimizer in one folder: "model.*" and "optimizer.*" entries plus
// `metadata` (e.g. {"step": "100"}). Collective.
void save_state(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                const std::map<std::string, std::string>& metadata = {}, const StateDictOptions& sd_options = {},
                const SaveOptions& options = {});
// Loads what save_state wrote onto `model` (any layout) and, when given,
// `optimizer` (its state and param groups; without one, the optimizer
// entries are skipped). Returns the metadata. Collective.
std::map<std::string, std::string> load_state(const std::string& dir, torch::nn::Module& model,
                                              torch::optim::Optimizer* optimizer,
                                              const StateDictOptions& sd_options = {},
                                              LoadOptions options = {});

}  // namespace dtp::dcp
