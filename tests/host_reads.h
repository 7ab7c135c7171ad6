// Counts reads of tensor values on the host (item(), a bool of a comparison):
// every one goes through aten::_local_scalar_dense, on the CPU as on a GPU,
// where each stops the host until the GPU has caught up.
#pragma once

#include <ATen/record_function.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

namespace dtp::test {

namespace detail {
inline std::atomic<int64_t> host_reads{0};
inline std::unique_ptr<at::ObserverContext> countHostRead(const at::RecordFunction& fn) {
  if (std::strcmp(fn.name(), "aten::_local_scalar_dense") == 0) ++host_reads;
  return nullptr;
}
}  // namespace detail

// Counts host reads, on every thread, while alive (one at a time).
class HostReads {
 public:
  HostReads()
      : handle_(at::addGlobalCallback(
            at::RecordFunctionCallback(detail::countHostRead).scopes({at::RecordScope::FUNCTION}))) {
    detail::host_reads = 0;
  }
  ~HostReads() { at::removeCallback(handle_); }
  HostReads(const HostReads&) = delete;
  HostReads& operator=(const HostReads&) = delete;
  int64_t count() const { return detail::host_reads; }

 private:
  at::CallbackHandle handle_;
};

}  // namespace dtp::test
