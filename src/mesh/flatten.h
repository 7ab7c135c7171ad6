// One process group over several dimensions of a mesh, as PyTorch's
// mesh["dp_replicate", "dp_shard"]._flatten("dp"): the ranks that differ
// from this one only on `dims`, in row-major order of those dimensions.
// HSDP's data-parallel batch spans both of its dimensions.
#pragma once

#include "dtp/device_mesh.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dtp {

// Made once per (whole mesh, dims), on the first call, collectively: every
// rank of the whole mesh from init_device_mesh (`mesh` itself, or the mesh
// `mesh` is a slice of, as a pipeline stage's (dp_replicate, dp_shard) of
// (pp, dp_replicate, dp_shard)) calls it for the same dimensions in the same
// order relative to other group creations; later calls return the same
// group. `api` names the caller in errors.
ProcessGroup flattened_group(const DeviceMesh& mesh, const std::vector<int64_t>& dims, const char* api);

// root[names] when one of `names` was given by DeviceMesh::flatten (else
// nullopt: a plain slice). See NOTE: [Flattened dimensions].
std::optional<DeviceMesh> slice_with_flattened(const std::shared_ptr<const DeviceMesh::Impl>& root,
                                               const std::vector<std::string>& names);

}  // namespace dtp
