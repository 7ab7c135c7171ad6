// dtp-bench --moe: one mixture-of-experts layer, expert parallelism over
// every rank (each its own tokens) against one device running all ranks'
// tokens, training step (forward + backward) and decode (forward of 1-8
// tokens per rank); and the dispatch all-to-all alone.
#pragma once

#include "dtp/process_group.h"

namespace dtp::bench {

// Prints the tables on rank 0; false when EP's outputs differ from one device's.
bool run_moe(int reps, int warmup, const ProcessGroup& world);

}  // namespace dtp::bench
