// What a rank learns about its job from the launcher's environment beyond
// RANK/WORLD_SIZE: where rank 0 is under Slurm, and the rank's place on its
// node. See NOTE: [Slurm across nodes] in job_env.cpp.
#pragma once

#include <optional>
#include <string>

namespace dtp::detail {

// The first host of a Slurm host list, compressed or not:
// "node[01-03,07],gpu5" -> "node01", "rack[1-2]-n[08-09]" -> "rack1-n08",
// "vm" -> "vm". A malformed list is an error naming it.
std::string first_slurm_host(const std::string& nodelist);

// MASTER_ADDR for a Slurm job that did not set it: the first host of
// SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST, else SLURM_NODELIST; none when
// none is set.
std::optional<std::string> slurm_master_addr();

// MASTER_PORT for Slurm job `job_id` (SLURM_JOB_ID): 15000 + its last four
// digits, as PyTorch Lightning derives it, so that two jobs sharing a node
// meet on different ports.
int slurm_master_port(const std::string& job_id);

// The rank's index on its node: LOCAL_RANK (torchrun, dtprun), else
// OMPI_COMM_WORLD_LOCAL_RANK (mpirun), else SLURM_LOCALID (srun); `name` is
// set to the variable it came from. None when none is set.
std::optional<int> local_rank(std::string* name = nullptr);

}  // namespace dtp::detail
