// What one rank writes of a state dict: see NOTE: [Sharded checkpoint layout]
// in include/dtp/dcp/checkpoint.h.
#pragma once

#include "dtp/dcp/state_dict.h"
#include "dtp/io/checkpoint_index.h"
#include "dtp/process_group.h"

#include <optional>

namespace dtp::dcp {

struct LocalPiece {
  std::string name;
  at::Tensor data;  // this rank's shard (or the whole plain tensor)
  std::vector<int64_t> offsets;
};

struct SavePlan {
  std::map<std::string, io::IndexedTensor> globals;  // without pieces
  std::vector<LocalPiece> pieces;                    // those this rank may write
  std::map<std::string, std::string> metadata;
};

// Checks the state dict (unique names, defined tensors, savable dtypes, no
// Partial) and lists this rank's candidate pieces: its non-empty shards,
// without those a lower mesh coordinate holds too (Replicate dims). Then
// keep_lowest_holders leaves each piece to the lowest rank holding it (a
// plain tensor, DDP's replicas outside the mesh, pipeline stages' tensors).
SavePlan plan_save(const StateDict& state_dict);

// The box of the global tensor that `t` holds on this rank: offsets and the
// local tensor (a view sharing memory). A plain tensor holds all of it.
struct LocalBox {
  std::vector<int64_t> offsets;
  at::Tensor local;
};
LocalBox local_box(const at::Tensor& t);

// Collective: of the pieces several ranks hold (same name, offsets and
// shape: a plain tensor, a DTensor replicated over ranks outside its mesh
// such as DDP's dp replicas), only the lowest rank's stay in its `pieces`.
void keep_lowest_holders(std::vector<LocalPiece>& pieces, const std::optional<ProcessGroup>& group, int rank);

// The file rank `rank` writes its pieces to.
std::string rank_file_name(int rank);
// index.json or a rank file: the entries a checkpoint folder holds (NOTE:
// [Nothing dtp did not write] in io/staged_dir.h).
bool is_checkpoint_entry(const std::string& name);

}  // namespace dtp::dcp
