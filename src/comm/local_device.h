// Which device this rank computes on: cuda:LOCAL_RANK, as torchrun users
// expect. See NOTE: [The rank's device] in local_device.cpp.
#pragma once

#include <c10/core/Device.h>

#include <string>

namespace dtp::detail {

// at::kCPU for "cpu"; for "cuda" this rank's GPU, which becomes the calling
// thread's current CUDA device. `rank` and `what` only serve the fallback
// and the errors.
c10::Device rank_device(const std::string& device_type, int rank, const std::string& what);

}  // namespace dtp::detail
