// Sharded load onto any layout: each rank reads the parts of the saved
// pieces that overlap its shards (NOTE: [Bounded box IO]).
#include "dtp/dcp/checkpoint.h"

#include "dcp/exchange.h"
#include "dcp/load_index.h"
#include "dcp/pieces.h"
#include "dtp/dtensor.h"
#include "dtp/io/box_io.h"
#include "io/staged_dir.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <filesystem>
#include <set>
#include <fstream>
#include <sstream>

namespace dtp::dcp {
namespace {

namespace fs = std::filesystem;

std::string shapeText(const std::vector<int64_t>& s) { return c10::str(c10::IntArrayRef(s)); }

// Opens each file once; checks its size and that it holds each piece where
// the index says.
class Files {
 public:
  Files(std::string dir, const io::CheckpointIndex& index) : dir_(std::move(dir)), index_(index) {}

  const io::StoredTensor& piece(const std::string& name, const io::CheckpointPiece& p) {
    auto it = open_.find(p.file);
    if (it == open_.end()) {
      auto f = std::make_unique<io::SafetensorsFile>(dir_ + "/" + p.file);
      const uint64_t expected = index_.files.at(p.file);
      TORCH_CHECK(f->size() == expected, "load: '", f->path(), "' has ", f->size(), " bytes, the index recorded ",
                  expected, ". The file was ", f->size() < expected ? "truncated" : "changed",
                  " after the save; load the previous checkpoint.");
      it = open_.emplace(p.file, std::move(f)).first;
    }
    const io::StoredTensor& s = it->second->at(name);
    TORCH_CHECK(s.begin == p.begin && s.end == p.end && s.shape == p.shape, "load: '", it->second->path(),
                "' holds '", name, "' at bytes [", s.begin, ", ", s.end, ") with shape ", shapeText(s.shape),
                ", the index says [", p.begin, ", ", p.end, ") with shape ", shapeText(p.shape),
                ". The folder mixes files of two saves; load the previous checkpoint.");
    return s;
  }
  const io::SafetensorsFile& file(const std::string& name) const { return *open_.at(name); }

 private:
  std::string dir_;
  const io::CheckpointIndex& index_;
  std::map<std::string, std::unique_ptr<io::SafetensorsFile>> open_;
};

struct Target {
  std::string name;
  const io::IndexedTensor* stored;
  LocalBox box;
};

// The part of `p` that overlaps the box, as (start in p, offsets in box, sizes).
bool intersect(const io::CheckpointPiece& p, const LocalBox& box, std::vector<int64_t>* in_piece,
               std::vector<int64_t>* in_box, std::vector<int64_t>* sizes) {
  in_piece->clear();
  in_box->clear();
  sizes->clear();
  for (size_t d = 0; d < p.shape.size(); ++d) {
    const int64_t lo = std::max(p.offsets[d], box.offsets[d]);
    const int64_t hi = std::min(p.offsets[d] + p.shape[d], box.offsets[d] + box.local.size(d));
    if (lo >= hi) return false;
    in_piece->push_back(lo - p.offsets[d]);
    in_box->push_back(lo - box.offsets[d]);
    sizes->push_back(hi - lo);
  }
  return true;
}

at::Tensor narrowed(at::Tensor t, const std::vector<int64_t>& start, const std::vector<int64_t>& sizes) {
  for (size_t d = 0; d < sizes.size(); ++d) t = t.narrow(d, start[d], sizes[d]);
  return t;
}

}  // namespace

io::CheckpointIndex read_index(const std::string& dir) {
  std::error_code ec;
  TORCH_CHECK(!fs::is_regular_file(dir, ec), "load: '", dir, "' is a file, not a checkpoint folder: a single-file "
              "checkpoint of an earlier dtp (format dtp-llama-1). dtp::models::load_checkpoint (and dtp-train "
              "--resume FILE) still read it; save again to convert it to a sharded folder.");
  const std::string path = dir + "/" + io::CheckpointIndex::kFileName;
  if (!fs::exists(path, ec)) {
    const bool incomplete = fs::exists(io::incomplete_dir(dir), ec) ||
                            (dir.size() > 11 && dir.compare(dir.size() - 11, 11, ".incomplete") == 0);
    TORCH_CHECK(false, "load: '", dir, "' is not a complete checkpoint: it has no ", io::CheckpointIndex::kFileName,
                ".", incomplete ? " A save to it did not finish ('" + io::incomplete_dir(dir) +
                                      "' holds what it wrote); load the previous checkpoint."
                                : " Pass a folder written by dtp's checkpoint save.");
  }
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  TORCH_CHECK(in.good() || in.eof(), "load: cannot read '", path, "'.");
  return io::CheckpointIndex::from_json(text.str(), path);
}

std::map<std::string, std::string> load(StateDict& state_dict, const std::string& dir, const LoadOptions& options) {
  return load_with_index(state_dict, dir, std::nullopt, options);
}

std::map<std::string, std::string> load_with_index(StateDict& state_dict, const std::string& dir,
                                                   std::optional<io::CheckpointIndex> known, const LoadOptions& options) {
  const auto group = checkpoint_group(options.group);
  const int rank = group ? group->rank() : 0, world = group ? group->size() : 1;
  const std::string what = "load of '" + dir + "'";
  agree_on_value(group, "dcp::load", "folders", dir);
  TORCH_CHECK(!dir.empty(), "dcp::load: no folder given (dir is \"\"). Name the checkpoint's folder.");
  io::CheckpointIndex index;
  std::vector<Target> targets;
  Files files(dir, index);
  // Everything is checked before any tensor changes: names, shapes, dtypes,
  // the files this rank reads, and (shared round-robin) the checksums.
  agree(group, error_of([&] {
    index = known ? std::move(*known) : read_index(dir);
    std::vector<std::string> missing, mismatched, unexpected, on_meta;
    std::set<std::string> asked;
    for (auto& [name, t] : state_dict.tensors) {
      asked.insert(name);
      auto it = index.tensors.find(name);
      if (it == index.tensors.end()) {
        missing.push_back(name);
        continue;
      }
      const auto shape = is_dtensor(t) ? dtensor_spec(t).shape : t.sizes().vec();
      if (shape != it->second.shape || t.scalar_type() != it->second.dtype) {
        mismatched.push_back("'" + name + "': saved " + c10::toString(it->second.dtype) + shapeText(it->second.shape) +
                             ", here " + c10::toString(t.scalar_type()) + shapeText(shape));
        continue;
      }
      targets.push_back({name, &it->second, local_box(t)});
      if (targets.back().box.local.is_meta()) on_meta.push_back(name);
    }
    TORCH_CHECK(on_meta.empty(), "'", dir, "' cannot be loaded into tensors on the meta device (deferred init: no "
                "memory yet): ", name_list(on_meta), ". Call init_weights(model) (or materialize the parameters) "
                "first; a load fills the tensors' memory in place.");
    for (const auto& [name, stored] : index.tensors) {
      bool ignored = asked.count(name) > 0;
      for (const auto& prefix : options.ignore_prefixes) ignored |= name.rfind(prefix, 0) == 0;
      if (!ignored) unexpected.push_back(name);
    }
    TORCH_CHECK(missing.empty() && mismatched.empty() && unexpected.empty(), "'", dir,
                "' does not match the state dict:",
                missing.empty() ? "" : "\n  missing from the checkpoint: " + name_list(missing),
                unexpected.empty() ? "" : "\n  in the checkpoint but not asked for: " + name_list(unexpected),
                mismatched.empty() ? "" : "\n  other dtype or shape: " + name_list(mismatched),
                "\nIs it a checkpoint of another model or model size? Build the same model (sizes, tied "
                "embeddings) as the run that saved it.");
    std::vector<int64_t> a, b, c;
    for (const auto& t : targets) {
      for (const auto& p : t.stored->pieces) {
        if (intersect(p, t.box, &a, &b, &c)) files.piece(t.name, p);
      }
    }
    if (!options.verify_checksums) return;
    size_t n = 0;
    for (const auto& [name, stored] : index.tensors) {
      for (const auto& p : stored.pieces) {
        if (static_cast<int>(n++ % world) != rank) continue;
        const io::StoredTensor& s = files.piece(name, p);
        const std::string got = files.file(p.file).crc32(s.begin, s.end, options.buffer_bytes);
        TORCH_CHECK(got == p.crc32, "'", dir, "/", p.file, "': the piece of '", name, "' at offsets ",
                    shapeText(p.offsets), " fails its checksum (CRC-32 ", got, ", recorded ", p.crc32,
                    "). The file is corrupted; load the previous checkpoint.");
      }
    }
  }), what);

  agree(group, error_of([&] {
    torch::NoGradGuard no_grad;
    std::vector<int64_t> inPiece, inBox, sizes;
    for (auto& t : targets) {
      for (const auto& p : t.stored->pieces) {
        if (!intersect(p, t.box, &inPiece, &inBox, &sizes)) continue;
        io::read_box(files.file(p.file), files.piece(t.name, p), inPiece, narrowed(t.box.local, inBox, sizes),
                     options.buffer_bytes);
      }
    }
  }), what);
  return index.metadata;
}

}  // namespace dtp::dcp
