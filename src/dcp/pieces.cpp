#include "dcp/pieces.h"

#include "dcp/exchange.h"
#include "dtp/dtensor.h"
#include "dtp/io/checkpoint_index.h"
#include "dtp/io/safetensors_file.h"

#include <cstdio>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <set>

namespace dtp::dcp {

std::string rank_file_name(int rank) {
  char name[32];
  std::snprintf(name, sizeof(name), "rank-%05d.safetensors", rank);
  return name;
}

bool is_checkpoint_entry(const std::string& name) {
  if (name == io::CheckpointIndex::kFileName) return true;
  const std::string head = "rank-", tail = ".safetensors";
  if (name.size() < head.size() + 5 + tail.size() || name.rfind(head, 0) != 0 ||
      name.compare(name.size() - tail.size(), tail.size(), tail) != 0) {
    return false;
  }
  return std::all_of(name.begin() + head.size(), name.end() - tail.size(), ::isdigit);
}

LocalBox local_box(const at::Tensor& t) {
  if (!is_dtensor(t)) return {std::vector<int64_t>(t.dim(), 0), t.detach()};
  const DTensorSpec& spec = dtensor_spec(t);
  return {spec.local_offset(), to_local(t.detach())};
}

SavePlan plan_save(const StateDict& state_dict) {
  SavePlan plan;
  plan.metadata = state_dict.metadata;
  std::set<std::string> names;
  for (const auto& [name, t] : state_dict.tensors) {
    TORCH_CHECK(names.insert(name).second, "save: the state dict has '", name, "' twice. Give each tensor one name.");
    TORCH_CHECK(t.defined(), "save: '", name, "' is an undefined tensor. Leave it out of the state dict.");
    TORCH_CHECK(io::safetensors_dtype_name(t.scalar_type()), "save: '", name, "' has dtype ", t.scalar_type(),
                ", which safetensors cannot hold. Convert it (e.g. to float32) before saving.");
    TORCH_CHECK(!local_box(t).local.is_meta(), "save: '", name, "' is on the meta device: got a tensor with no values (a model built with "
                "deferred init, not yet initialized), expected one that holds its values. Call init_weights(model) "
                "(or load weights into it) before saving.");
    io::IndexedTensor global;
    global.dtype = t.scalar_type();
    bool writer = true;  // a plain tensor: its lowest holder writes it (keep_lowest_holders)
    if (is_dtensor(t)) {
      const DTensorSpec& spec = dtensor_spec(t);
      TORCH_CHECK(!spec.has_partial(), "save: '", name, "' is ", spec.str(),
                  ", a Partial DTensor (a pending sum). Redistribute it to Replicate or Shard before saving.");
      global.shape = spec.shape;
      // Over Replicate mesh dims only coordinate 0 writes: the lowest rank
      // holding these bytes.
      const auto coordinate = spec.mesh.get_coordinate();
      for (size_t d = 0; d < spec.placements.size(); ++d) writer &= !spec.placements[d].is_replicate() || coordinate[d] == 0;
    } else {
      global.shape = t.sizes().vec();
    }
    plan.globals.emplace(name, global);
    if (!writer) continue;
    LocalBox box = local_box(t);
    if (box.local.numel() == 0) continue;
    plan.pieces.push_back({name, box.local, box.offsets});
  }
  return plan;
}

void keep_lowest_holders(std::vector<LocalPiece>& pieces, const std::optional<ProcessGroup>& group, int rank) {
  using Json = nlohmann::json;
  auto key = [](const LocalPiece& p) {
    return p.name + "@" + c10::str(c10::IntArrayRef(p.offsets)) + c10::str(p.data.sizes());
  };
  Json mine = Json::array();
  for (const auto& p : pieces) mine.push_back(key(p));
  const auto all = all_gather_strings(group, mine.dump());
  std::map<std::string, int> lowest;
  for (int r = static_cast<int>(all.size()) - 1; r >= 0; --r) {
    for (const auto& k : Json::parse(all[r])) lowest[k.get<std::string>()] = r;
  }
  std::vector<LocalPiece> kept;
  for (auto& p : pieces) {
    if (lowest.at(key(p)) == rank) kept.push_back(std::move(p));
  }
  pieces = std::move(kept);
}

}  // namespace dtp::dcp
