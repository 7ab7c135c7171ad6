// A mesh over some dimensions of another, in any order, sharing its process
// groups: select_mesh_dims(mesh(dp, tp), {1, 0}) is the (tp, dp) mesh. The
// public operator[] keeps mesh order, as PyTorch's; fully_shard needs the
// transposed mesh, on which [tp placement, S(0)] nests the dp shard inside
// the tp shard (what PyTorch's _StridedShard expresses). Ranks outside this
// rank's line of the dropped dimensions are not included.
#pragma once

#include "dtp/device_mesh.h"

namespace dtp {

DeviceMesh select_mesh_dims(const DeviceMesh& mesh, const std::vector<int64_t>& dims);

}  // namespace dtp
