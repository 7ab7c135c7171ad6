#include "dtp/parallel_dims.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>

namespace dtp {

// NOTE: [Mesh dimension names]
// dtp's parallelisms find their mesh dimensions by name, and the names are
// read in one place, parallel_mesh_dims, so that a mesh a user builds by
// hand and one ParallelDims::build_mesh makes (torchtitan's names) mean the
// same thing to parallelize_llama, fully_shard / replicate, expert
// parallelism and data_parallel_group:
//   - FSDP shards over the "dp_shard" part: a hand-built "dp" or "dp_shard",
//     ParallelDims' "dp_shard" (or, with ep, "dp_shard_mod_ep", the ranks
//     that hold the same experts), or a flattened "dp" / "dp_shard_cp" in a
//     slice such as root[{"dp_shard_cp", "tp"}].
//   - The experts are spread over the "ep" part: a hand-built "ep", or
//     ParallelDims' "dp_shard_in_ep" (a flattened "ep" on the root).
//   - The batch is cut over dp_replicate x dp_shard x ep: on (dp=2, ep=2,
//     tp=2) and on ParallelDims().dp_shard(4).ep(2).tp(2)'s
//     (dp_shard_mod_ep=2, dp_shard_in_ep=2, tp=2) alike, 4 ranks.
// Under expert parallelism, the parameters outside the experts are data
// parallel over that whole (dp_shard, ep) run, flattened on the root as
// "dp_shard_cp" (torchtitan's name for FSDP's dimension; ParallelDims
// registers it, parallelize_llama registers it on a hand-built mesh), so
// every parameter lives on the user's mesh or a slice of it.
// A "cp" dimension is context parallelism: parameters replicated over it
// and data parallel over (dp_shard, cp), flattened as "dp_shard_cp" (NOTE:
// [Data parallelism over cp] in src/fsdp/data_parallel.cpp). With both "cp"
// and an "ep" part, the experts are spread over ep x cp, as torchtitan's
// ep = (dp_shard_in_ep, cp): ParallelDims registers that run as "ep", and
// parallelize_llama flattens a hand-built (dp, ep, cp)'s as "ep_cp", which
// reads as the "ep" part too (NOTE: [Context parallelism with expert
// parallelism] in src/models/llama_parallelize.cpp). So that the mesh names
// expert parallelism when ep = cp, ParallelDims keeps dp_shard_in_ep there
// at size 1 (torchtitan drops it and reads ep from its ParallelDims).

namespace {

constexpr const char* kApi = "ParallelDims";

std::string degrees(const ParallelDims& d) {
  return c10::str("dp_replicate(", d.dp_replicate(), ") * dp_shard(", d.dp_shard(), ") * cp(", d.cp(), ") * tp(",
                  d.tp(), ") * pp(", d.pp(), ")");
}

void checkValidated(const ParallelDims& d, const char* what) {
  TORCH_CHECK(d.dp_shard() >= 1, "ParallelDims::", what, ": dp_shard: got ", d.dp_shard(),
              ", expected the inferred degree. Call validate() first (it infers dp_shard = -1 from world_size).");
}

bool isIn(const std::vector<std::string>& names, const std::string& n) {
  return std::find(names.begin(), names.end(), n) != names.end();
}

}  // namespace

ParallelDims& ParallelDims::validate() {
  for (const auto& [name, value] : {std::pair<const char*, int64_t>{"dp_replicate", dp_replicate_}, {"cp", cp_},
                                    {"tp", tp_}, {"pp", pp_}, {"ep", ep_}}) {
    TORCH_CHECK(value >= 1, kApi, ": degree ", name, ": got ", value, ", expected >= 1 (only dp_shard may be -1, "
                "inferred). Pass 1 for a parallelism that is off.");
  }
  TORCH_CHECK(dp_shard_ == -1 || dp_shard_ >= 1, kApi, ": degree dp_shard: got ", dp_shard_, ", expected -1 "
              "(inferred from world_size) or >= 1. Pass -1 or the degree.");
  TORCH_CHECK(world_size_ >= 1, kApi, ": world_size: got ", world_size_, ", expected the number of ranks (>= 1). "
              "Pass world_size(n).");
  if (dp_shard_ == -1) {
    const int64_t rest = dp_replicate_ * cp_ * tp_ * pp_;
    TORCH_CHECK(world_size_ % rest == 0, kApi, ": inferring dp_shard from WORLD_SIZE(", world_size_,
                ") / (dp_replicate(", dp_replicate_, ") * cp(", cp_, ") * tp(", tp_, ") * pp(", pp_, ")) = ",
                world_size_, " / ", rest, ": got a world size the other degrees' product does not divide, expected "
                "a multiple of ", rest, ". Change the degrees or the world size.");
    dp_shard_ = world_size_ / rest;
  }
  const int64_t product = dp_replicate_ * dp_shard_ * cp_ * tp_ * pp_;
  TORCH_CHECK(product == world_size_, kApi, ": invalid parallel dims: ", degrees(*this), " = ", product,
              " != WORLD_SIZE(", world_size_, "). Make the product the world size, or pass dp_shard(-1) to infer it.");
  if (ep_ > 1) {
    TORCH_CHECK(ep_ % cp_ == 0 && (dp_shard_ * cp_) % ep_ == 0, kApi, ": ep(", ep_,
                ") borrows from dp_shard(", dp_shard_, ") * cp(", cp_, ") = ", dp_shard_ * cp_,
                ": got an ep that is not a multiple of cp or does not divide dp_shard * cp, expected both. "
                "Pick ep among the multiples of cp that divide dp_shard * cp.");
  }
  return *this;
}

bool ParallelDims::dp_enabled() const { return dp_replicate_enabled() || dp_shard_enabled(); }
bool ParallelDims::dp_replicate_enabled() const { return dp_replicate_ > 1; }
bool ParallelDims::dp_shard_enabled() const {
  checkValidated(*this, "dp_shard_enabled");
  return dp_shard_ > 1;
}
bool ParallelDims::cp_enabled() const { return cp_ > 1; }
bool ParallelDims::dp_cp_enabled() const { return dp_enabled() || cp_enabled(); }
bool ParallelDims::fsdp_enabled() const { return dp_shard_enabled() || cp_enabled(); }
bool ParallelDims::tp_enabled() const { return tp_ > 1; }
bool ParallelDims::pp_enabled() const { return pp_ > 1; }
bool ParallelDims::ep_enabled() const { return ep_ > 1; }
int64_t ParallelDims::fsdp_gradient_divide_factor() const {
  checkValidated(*this, "fsdp_gradient_divide_factor");
  return dp_replicate_ * dp_shard_ * cp_;
}
int64_t ParallelDims::non_data_parallel_size() const { return cp_ * tp_ * pp_; }
int64_t ParallelDims::seq_len_divisor() const { return tp_ * cp_ * 2; }

namespace {

// (name, degree) of every dimension build_mesh makes, in torchtitan's order.
std::vector<std::pair<std::string, int64_t>> meshDims(const ParallelDims& d) {
  checkValidated(d, "build_mesh");
  std::vector<std::pair<std::string, int64_t>> all = {{"pp", d.pp()}, {"dp_replicate", d.dp_replicate()}};
  if (d.ep() > 1) {
    // dp_shard * cp = dp_shard_mod_ep * ep, and ep = dp_shard_in_ep * cp.
    all.emplace_back("dp_shard_mod_ep", d.dp_shard() * d.cp() / d.ep());
    all.emplace_back("dp_shard_in_ep", d.ep() / d.cp());
  } else {
    all.emplace_back("dp_shard", d.dp_shard());
  }
  all.emplace_back("cp", d.cp());
  all.emplace_back("tp", d.tp());
  std::vector<std::pair<std::string, int64_t>> out;
  // dp_shard_mod_ep stays at 1, as torchtitan's: the experts' FSDP dimension;
  // so does dp_shard_in_ep (ep = cp), dtp's mark of expert parallelism
  // (NOTE: [Mesh dimension names]).
  for (const auto& [n, size] : all)
    if (size > 1 || n == "dp_shard_mod_ep" || n == "dp_shard_in_ep") out.emplace_back(n, size);
  if (out.empty()) out.emplace_back("dp_shard", 1);  // one rank: a 1-D mesh of one
  return out;
}

}  // namespace

std::vector<std::string> ParallelDims::mesh_dim_names() const {
  std::vector<std::string> out;
  for (const auto& [n, size] : meshDims(*this)) out.push_back(n);
  return out;
}

std::vector<int64_t> ParallelDims::mesh_shape() const {
  std::vector<int64_t> out;
  for (const auto& [n, size] : meshDims(*this)) out.push_back(size);
  return out;
}

std::vector<std::pair<std::string, std::vector<std::string>>> ParallelDims::flattened_dims() const {
  const std::vector<std::string> names = mesh_dim_names();
  auto present = [&](std::initializer_list<const char*> want) {
    std::vector<std::string> out;
    for (const char* n : want)
      if (isIn(names, n)) out.emplace_back(n);
    return out;
  };
  std::vector<std::pair<std::string, std::vector<std::string>>> out;
  auto add = [&](const char* name, std::vector<std::string> dims) {
    if (!dims.empty()) out.emplace_back(name, std::move(dims));
  };
  add("dp", present({"dp_replicate", "dp_shard", "dp_shard_mod_ep", "dp_shard_in_ep"}));
  add("dp_shard_cp", present({"dp_shard", "dp_shard_mod_ep", "dp_shard_in_ep", "cp"}));
  add("dp_cp", present({"dp_replicate", "dp_shard", "dp_shard_mod_ep", "dp_shard_in_ep", "cp"}));
  if (ep_ > 1) add("ep", present({"dp_shard_in_ep", "cp"}));
  return out;
}

DeviceMesh ParallelDims::build_mesh(const std::string& device_type, std::optional<ProcessGroup> world) const {
  ParallelDims d = *this;
  d.validate();
  const ProcessGroup group = world ? *world : default_process_group();
  TORCH_CHECK(group.valid() && group.size() == d.world_size(), "ParallelDims::build_mesh: world_size(",
              d.world_size(), "): got a world of ", group.valid() ? group.size() : 0, " ranks, expected ",
              d.world_size(), ". Pass world_size(", group.valid() ? group.size() : 0, "), or run on that many ranks.");
  DeviceMesh mesh = init_device_mesh(device_type, d.mesh_shape(), d.mesh_dim_names(), std::move(world));
  for (const auto& [name, dims] : d.flattened_dims()) mesh[dims].flatten(name);
  return mesh;
}

ParallelMeshDims parallel_mesh_dims(const DeviceMesh& mesh) {
  ParallelMeshDims out;
  const std::vector<std::pair<std::optional<std::string> ParallelMeshDims::*, std::vector<const char*>>> parts = {
      {&ParallelMeshDims::pp, {"pp"}},
      {&ParallelMeshDims::dp_replicate, {"dp_replicate"}},
      {&ParallelMeshDims::dp_shard, {"dp", "dp_shard", "dp_shard_mod_ep", "dp_shard_cp"}},
      {&ParallelMeshDims::ep, {"ep", "dp_shard_in_ep", "ep_cp"}},
      {&ParallelMeshDims::cp, {"cp"}},
      {&ParallelMeshDims::tp, {"tp"}},
  };
  for (const auto& name : mesh.mesh_dim_names()) {
    bool found = false;
    for (const auto& [field, names] : parts) {
      if (std::find(names.begin(), names.end(), name) == names.end()) continue;
      std::optional<std::string>& slot = out.*field;
      TORCH_CHECK(!slot, "DeviceMesh: dimensions of ", mesh.str(), ": got both \"", *slot, "\" and \"", name,
                  "\", which play the same part (", c10::Join(", ", names), "), expected one of them. Name one "
                  "dimension for each parallelism (NOTE: [Mesh dimension names] in src/mesh/parallel_dims.cpp).");
      slot = name;
      found = true;
      if (field == &ParallelMeshDims::dp_replicate || field == &ParallelMeshDims::dp_shard ||
          field == &ParallelMeshDims::ep)
        out.batch.push_back(name);
    }
    if (!found) out.others.push_back(name);
  }
  return out;
}

}  // namespace dtp
