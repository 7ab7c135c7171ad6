// dtp-bench --async: redistribute(..., async_op=true) against the same
// program with every redistribution synchronous (SyncRedistributeScope),
// interleaved A B A B in one run: (1) the reference Llama's TP training step,
// whose styles redistribute inputs and outputs async as PyTorch's do (each
// use follows its issue at once); (2) a TP step with independent compute
// between the issue of an all_gather and its use, through shared memory and
// through Gloo. NOTE: [Async redistribution].
#pragma once

#include "sizes.h"

#include "dtp/process_group.h"

#include <vector>

namespace dtp::bench {

// Prints the tables on rank 0; false when async and sync differ in loss or
// in the collectives counted.
bool run_async(const std::vector<const Size*>& sizes, int reps, int warmup, const ProcessGroup& world);

}  // namespace dtp::bench
