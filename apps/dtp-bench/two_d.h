// dtp-bench --dp N: one training step on a (dp, tp) mesh, FSDP and DDP on
// top of TP, against the same step with TP alone on this rank's batch
// (compute and TP communication, no data parallelism) and against the data
// parallelism's collectives replayed alone (communication only): how much of
// that communication the step hides behind compute. Also the collectives per
// step against their closed form, and the memory of parameters, gradients
// and AdamW state per rank against one device's.
#pragma once

#include "sizes.h"

#include "dtp/process_group.h"

#include <vector>

namespace dtp::bench {

// Prints the tables on rank 0; false when a check failed (losses that
// disagree, collectives off their closed form).
bool run_two_d(const std::vector<const Size*>& sizes, int64_t dp, int reps, int warmup, const ProcessGroup& world);

}  // namespace dtp::bench
