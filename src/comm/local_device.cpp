#include "comm/local_device.h"

#include "comm/job_env.h"

#include <ATen/Context.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <iostream>
#include <string>

namespace dtp::detail {

// NOTE: [The rank's device] A rank uses GPU LOCAL_RANK (set by torchrun and
// dtprun; the rank on its node), made the thread's current CUDA device so
// that NCCL, the caching allocator and kernels without an explicit device
// all agree. mpirun's OMPI_COMM_WORLD_LOCAL_RANK and srun's SLURM_LOCALID
// stand in for LOCAL_RANK. Without any (ranks as threads), PyTorch's
// fallback: rank % number of visible GPUs, said once on stderr. A LOCAL_RANK
// beyond the visible GPUs is an error: NCCL refuses two ranks on one GPU.
c10::Device rank_device(const std::string& device_type, int rank, const std::string& what) {
  if (device_type == "cpu") return c10::Device(c10::kCPU);
  TORCH_CHECK(device_type == "cuda", what, ": device_type '", device_type, "' is not supported. Use \"cpu\" or \"cuda\".");
  TORCH_CHECK(at::hasCUDA(), what, ": device_type \"cuda\", but this process sees no CUDA device (or libtorch ",
              "was built without CUDA). Use \"cpu\", or run on a machine with GPUs and a CUDA libtorch.");
  const auto& guard = *c10::impl::getDeviceGuardImpl(c10::kCUDA);
  const int count = static_cast<int>(guard.deviceCount());
  int index = rank % count;
  std::string from;
  if (const auto local = local_rank(&from)) {
    index = *local;
    TORCH_CHECK(index < count, what, ": ", from, "=", index,
                " but this process sees ", count, " CUDA device(s). Start at most ", count,
                " ranks per node (dtprun/torchrun --nproc-per-node), or check CUDA_VISIBLE_DEVICES.");
  } else {
    static std::atomic<bool> said{false};
    if (!said.exchange(true)) std::cerr << what << ": no LOCAL_RANK in the environment; rank " << rank << " uses cuda:" << index
                         << " (rank % " << count << " visible GPUs).\n";
  }
  const c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  guard.setDevice(device);
  return device;
}

}  // namespace dtp::detail
