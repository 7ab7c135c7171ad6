// Redistribution of one rank's shard between placements on the same mesh.
#pragma once

#include "dtp/comm_counter.h"
#include "dtp/dtensor_spec.h"

#include <ATen/core/Tensor.h>

#include <optional>

namespace dtp {

// One step of a redistribution: a single mesh dimension changes placement.
struct RedistributeStep {
  int64_t mesh_dim;
  Placement from, to;
};

// The collective one step costs on a mesh dimension of `group_size` ranks,
// or nullopt when it is local (from R: a chunk or zeroing; a one-rank dim):
// S -> S all_to_all, S -> R or P all_gather, P -> S reduce_scatter,
// P -> R all_reduce.
std::optional<CollectiveType> transition_collective(const Placement& from, const Placement& to, int64_t group_size);

// Plans src -> dst per mesh dimension, the way PyTorch's _redistribute.py
// does. See NOTE: [Redistribute order] in redistribute.cpp.
std::vector<RedistributeStep> plan_redistribute(const DTensorSpec& src, const Placements& dst);

// This rank's shard of `dst` computed from its shard `local` of `src`.
// `backward`: the transition runs on a gradient, where R -> P keeps the value
// on every rank (each rank's partial contributed the whole gradient).
// `consume`: nothing else sees `local` (solely_owned), so P -> R reduces it in
// place instead of into a copy.
at::Tensor redistribute_local(const at::Tensor& local, const DTensorSpec& src,
                              const Placements& dst, bool backward = false, bool consume = false);

}  // namespace dtp
