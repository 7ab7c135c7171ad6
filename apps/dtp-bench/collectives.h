// dtp-bench --collectives: latency and bandwidth of all_reduce, all_gather
// and reduce_scatter by message size (float32), on each CPU path side by
// side in one run: Gloo over loopback TCP alone (a group made with DTP_SHM=0)
// and the shared-memory path (a group whose slots hold the largest size;
// NOTE: [Shared-memory collectives] in src/comm/shm_group.cpp), interleaved
// rep by rep. Prints the crossover per collective: the largest size at
// which shared memory still wins.
#pragma once

#include "dtp/process_group.h"

#include <cstdint>
#include <vector>

namespace dtp::bench {

struct CollectiveOptions {
  int reps = 5;
  // Message sizes in bytes: the all_reduce tensor, the all_gather output, the reduce_scatter input.
  std::vector<int64_t> sizes{1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20};
};

// Prints the table on rank 0; false when the two paths' results differ.
bool run_collectives(const CollectiveOptions& options, const ProcessGroup& world);

}  // namespace dtp::bench
