// dtp-bench --soak N: N training steps of a small Llama under TP (with
// sequence parallelism), then N decode steps (batch 2) under the inference plan,
// reporting at ten intervals this process's resident memory, the size of the
// sharding-decision cache (sharding_prop.h, the one cache that grows with
// what runs) and the time per step. Exits non-zero when any
// of the three grows after the first interval (warm-up) beyond its bound:
// see NOTE: [Soak bounds] in soak.cpp.
#pragma once

#include "dtp/process_group.h"

#include <cstdint>

namespace dtp::bench {

// False (on every rank) when something grew.
bool run_soak(int64_t steps, const ProcessGroup& world);

}  // namespace dtp::bench
