// The torchrun environment each rank starts with.
#pragma once

#include <string>
#include <vector>

#include "launch_options.h"

namespace dtprun {

// Asks the kernel for a free TCP port on 127.0.0.1 (bind port 0, read it back,
// close). Another process may take it before rank 0 binds it, but concurrent
// jobs on one machine no longer all fight over 29500. Throws on failure.
int pick_free_port();

// Unless the user set them, sets in dtprun's own environment (which every
// rank inherits) OMP_NUM_THREADS to max(1, usable CPUs / local ranks) and,
// with several local ranks, OMP_WAIT_POLICY to PASSIVE; says so on stderr.
void default_omp_environment(int local_ranks);

// dtprun's environment plus RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// GROUP_RANK, MASTER_ADDR and MASTER_PORT for `local_rank`, as "KEY=value".
std::vector<std::string> rank_environment(const LaunchOptions& options, int local_rank);

// The rank number printed in output prefixes and messages.
int global_rank(const LaunchOptions& options, int local_rank);

} // namespace dtprun
