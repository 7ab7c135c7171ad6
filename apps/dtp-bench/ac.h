// dtp-bench --ac: the cost of activation checkpointing on a TP step: step
// time, and memory per rank (live at the end of forward; peak during the
// step) without AC, with full AC and with selective AC.
#pragma once

#include "sizes.h"

#include "dtp/process_group.h"

#include <vector>

namespace dtp::bench {

// Prints the table on rank 0; false when the variants' first losses differ.
bool run_ac(const std::vector<const Size*>& sizes, int reps, int warmup, const ProcessGroup& world);

}  // namespace dtp::bench
