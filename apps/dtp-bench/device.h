// dtp-bench --device cpu|cuda: what DTensor costs on a training step on one
// device: dtp's TP Llama (over all ranks, on the mesh's device) against the
// same model in plain libtorch on rank 0's device, interleaved rep by rep.
// At one rank this is DTensor's whole cost: no collective moves anything.
#pragma once

#include "sizes.h"

#include "dtp/process_group.h"

#include <string>
#include <vector>

namespace dtp::bench {

// Prints the table on rank 0; false when dtp's first loss differs from plain libtorch's.
// A `profile_dir` also profiles one step of each variant after the timed ones
// (profile.h): traces <size>-<variant>.json there (-rankN for ranks above 0)
// and tables of their top host ops.
bool run_device(const std::vector<const Size*>& sizes, const std::string& device_type, const std::vector<bool>& sps,
                int reps, int warmup, const ProcessGroup& world, const std::string& profile_dir = "");

}  // namespace dtp::bench
