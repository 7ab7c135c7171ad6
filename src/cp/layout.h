// Context parallelism's internal layout helpers (the public ones are in
// include/dtp/cp/context_parallel.h).
#pragma once

#include "dtp/cp/context_parallel.h"

#include <vector>

namespace dtp::cp {

// Every cp rank's local length, in rank order.
std::vector<int64_t> localLens(int64_t seq_len, int64_t cp_size, CpLayout layout);
// The global positions of `segments`, concatenated: int64 [sum of lengths].
at::Tensor positionsOf(const std::vector<SeqSegment>& segments, c10::Device device);

}  // namespace dtp::cp
