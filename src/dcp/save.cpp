// Sharded save. See NOTE: [Sharded checkpoint layout] and NOTE: [Atomic
// checkpoint folders] in include/dtp/dcp/checkpoint.h.
#include "dtp/dcp/checkpoint.h"

#include "dcp/exchange.h"
#include "dcp/pieces.h"
#include "dcp/save_plan.h"
#include "dtp/io/safetensors.h"
#include "io/file_util.h"
#include "io/staged_dir.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace dtp::dcp {
namespace {

using Json = nlohmann::json;

// This rank's file: its pieces, and what the index needs to know of them.
Json writeRankFile(const SavePlan& plan, const std::string& folder, int rank) {
  if (plan.pieces.empty()) return Json{{"file", ""}, {"size", 0}, {"pieces", Json::array()}};
  const std::string file = rank_file_name(rank);
  io::TensorMap tensors;
  for (const auto& p : plan.pieces) tensors.emplace_back(p.name, p.data);
  const io::SavedFile saved = io::save_safetensors(folder + "/" + file, tensors, {{"format", "pt"}});
  std::vector<std::pair<std::string, io::CheckpointPiece>> pieces;
  for (size_t i = 0; i < plan.pieces.size(); ++i) {
    const auto& s = saved.tensors[i];
    pieces.emplace_back(plan.pieces[i].name, io::CheckpointPiece{plan.pieces[i].offsets,
                                                                 plan.pieces[i].data.sizes().vec(), file, s.begin,
                                                                 s.end, s.crc32});
  }
  return Json{{"file", file}, {"size", saved.size}, {"pieces", Json::parse(io::pieces_to_json(pieces))}};
}

// NOTE: [Tensors of some ranks] Ranks may hold different tensors (pipeline
// stages hold their own layers): the index lists every rank's, and a name
// two ranks hold must have one dtype and shape.
Json globalsToJson(const std::map<std::string, io::IndexedTensor>& globals) {
  Json out = Json::object();
  for (const auto& [name, g] : globals) out[name] = {{"dtype", static_cast<int>(g.dtype)}, {"shape", g.shape}};
  return out;
}

std::map<std::string, io::IndexedTensor> mergeGlobals(const std::vector<std::string>& records) {
  std::map<std::string, io::IndexedTensor> out;
  std::map<std::string, size_t> first;  // the rank that named it first
  for (size_t r = 0; r < records.size(); ++r) {
    const Json record = Json::parse(records[r].substr(1));
    for (const auto& [name, g] : record.at("globals").items()) {
      io::IndexedTensor t;
      t.dtype = static_cast<at::ScalarType>(g.at("dtype").get<int>());
      t.shape = g.at("shape").get<std::vector<int64_t>>();
      auto [it, fresh] = out.emplace(name, t);
      if (fresh) {
        first[name] = r;
        continue;
      }
      TORCH_CHECK(it->second.dtype == t.dtype && it->second.shape == t.shape, "ranks ", first[name], " and ", r,
                  " hold '", name, "' as ", c10::toString(it->second.dtype), c10::IntArrayRef(it->second.shape),
                  " and ", c10::toString(t.dtype), c10::IntArrayRef(t.shape), ". Give a name one global tensor on "
                  "every rank that holds it.");
    }
  }
  return out;
}

// An index.json in the folder a save replaces must be dtp's own.
void checkOwnIndex(const std::string& dir) {
  const std::string path = dir + "/" + io::CheckpointIndex::kFileName;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return;
  std::ifstream in(path);
  std::string format;
  try {
    format = Json::parse(in).value("format", "");
  } catch (const Json::exception&) {
  }
  TORCH_CHECK(format.rfind("dtp-checkpoint-", 0) == 0, "save: '", path, "' is not the index of a dtp checkpoint "
              "(format '", format, "'), so dtp does not replace the folder. Save to a new folder, or move '", dir,
              "' away.");
}

}  // namespace

void write_plan(SavePlan plan, const std::string& dir, const std::optional<ProcessGroup>& group) {
  const int rank = group ? group->rank() : 0;
  keep_lowest_holders(plan.pieces, group, rank);
  const std::string folder = io::incomplete_dir(dir);
  const std::string what = "save of '" + dir + "'";
  // Rank 0 stages the folder (NOTE: [Nothing dtp did not write]).
  std::optional<io::StagedDir> staged;
  agree(group, rank != 0 ? "" : error_of([&] {
    checkOwnIndex(dir);
    staged.emplace(dir, is_checkpoint_entry, io::StagedDir::Mode::kReplace, "save");
  }), what);

  std::string record;
  const std::string error = error_of([&] {
    Json j = writeRankFile(plan, folder, rank);
    j["globals"] = globalsToJson(plan.globals);
    record = j.dump();
  });
  const auto records = all_gather_strings(group, error.empty() ? "+" + record : "-" + error);
  std::string failures;
  for (size_t r = 0; r < records.size(); ++r) {
    if (records[r][0] == '-') failures += "\n  rank " + std::to_string(r) + ": " + records[r].substr(1);
  }
  TORCH_CHECK(failures.empty(), what, " failed (the previous checkpoint is unchanged):", failures);

  // Rank 0 indexes every rank's pieces and commits the folder.
  agree(group, rank != 0 ? "" : error_of([&] {
    io::CheckpointIndex index;
    index.metadata = plan.metadata;
    index.tensors = mergeGlobals(records);
    for (const auto& r : records) {
      const Json j = Json::parse(r.substr(1));
      if (j.at("file").get<std::string>().empty()) continue;
      index.files[j.at("file").get<std::string>()] = j.at("size").get<uint64_t>();
      for (auto& [name, piece] : io::pieces_from_json(j.at("pieces").dump())) {
        index.tensors.at(name).pieces.push_back(std::move(piece));
      }
    }
    io::write_file_synced(folder + "/" + io::CheckpointIndex::kFileName, index.to_json());
    staged->commit();
  }), what);
}

void save(const StateDict& state_dict, const std::string& dir, const SaveOptions& options) {
  const auto group = checkpoint_group(options.group);
  agree_on_value(group, "dcp::save", "folders", dir);
  TORCH_CHECK(!dir.empty(), "dcp::save: no folder given (dir is \"\"). Name the checkpoint's folder, e.g. \"ckpt/step-100\".");
  SavePlan plan;
  agree(group, error_of([&] { plan = plan_save(state_dict); }), "save of '" + dir + "'");
  write_plan(std::move(plan), dir, group);
}

}  // namespace dtp::dcp
