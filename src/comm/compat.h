// The one place where libtorch 1.13 and 2.x differ for dtp.
//
// - c10d backends: in 1.13 ProcessGroupGloo/NCCL derive from c10d::ProcessGroup;
//   in 2.x they derive from c10d::Backend (ProcessGroup became a dispatcher over
//   backends). dtp talks to the backend object directly, so it only needs the
//   common base class.
// - TCPStore gained a libuv server in 2.x; dtp keeps the classic one so that
//   both lines behave the same.
// - torch::optim keys per-parameter state by the TensorImpl's address: as a
//   string in 1.13, as void* from 2.1.
// - c10::Allocator::allocate is const in 1.13 and not from 2.3 (when
//   copy_data became pure virtual): DTP_ALLOCATE_CONST.
// - c10::Error takes its backtrace as a string in 1.13 and as a lazy value
//   in 2.x: error_without_backtrace.
// - Kineto's C++ profiler API (torch::autograd::profiler::enableProfiler with
//   torch::profiler::impl's config), which dtp-bench --profile uses, is 2.x's:
//   DTP_HAS_KINETO.
// - Fused attention: at::scaled_dot_product_attention and the CPU flash
//   kernel it picks (_scaled_dot_product_flash_attention_for_cpu) are 2.2's:
//   DTP_HAS_SDPA; the _safe_softmax of its math path is 2.5's:
//   DTP_HAS_SAFE_SOFTMAX.
// - float16 matrix products on CPU (addmm for Half) are 2.1's: 1.13 has
//   none (removed in 1.12), so float16 compute on CPU needs
//   DTP_HAS_CPU_HALF_MATMUL (checked here on 2.6).
// - c10::MemoryReportingInfoBase::reportMemoryUsage takes the allocator's
//   totals as int64_t in 1.13 and as size_t in 2.x: MemoryReportTotal, read
//   off the declaration itself.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <c10/util/string_utils.h>

#include <string>
#include <type_traits>

#include <torch/version.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define DTP_ALLOCATE_CONST
#else
#define DTP_ALLOCATE_CONST const
#endif

#define DTP_HAS_KINETO (TORCH_VERSION_MAJOR >= 2)
#define DTP_HAS_SDPA (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 2))
#define DTP_HAS_CPU_HALF_MATMUL (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1))
#define DTP_HAS_SAFE_SOFTMAX (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5))

namespace dtp::compat {

#if TORCH_VERSION_MAJOR >= 2
using Backend = c10d::Backend;
#else
using Backend = c10d::ProcessGroup;
#endif

namespace detail {
template <class F>
struct ThirdArgument;
template <class C, class R, class A1, class A2, class A3, class... Rest>
struct ThirdArgument<R (C::*)(A1, A2, A3, Rest...)> {
  using type = A3;
};
}  // namespace detail

// The type of reportMemoryUsage's total_allocated and total_reserved.
using MemoryReportTotal = detail::ThirdArgument<decltype(&c10::MemoryReportingInfoBase::reportMemoryUsage)>::type;

inline c10d::TCPStoreOptions tcp_store_options(
    uint16_t port, bool is_server, size_t world_size,
    std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = port;
  opts.isServer = is_server;
  opts.numWorkers = world_size;
  opts.waitWorkers = false;  // rendezvous.cpp counts the ranks that joined itself
  opts.timeout = timeout;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  opts.useLibUV = false;
#endif
  return opts;
}

inline auto optimizer_state_key(const at::Tensor& param) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
  return static_cast<void*>(param.unsafeGetTensorImpl());
#else
  return c10::guts::to_string(param.unsafeGetTensorImpl());
#endif
}

// A c10::Error whose what() is `msg` alone, for failures a user should read
// in one line (a peer that did not arrive); TORCH_SHOW_CPP_STACKTRACES=1
// asks for the C++ backtrace (TORCH_CHECK's) instead.
template <class E = c10::Error>
E error_without_backtrace(std::string msg) {
  if constexpr (std::is_constructible_v<E, std::string, std::string>) return E(std::move(msg), std::string());
  else return E(std::move(msg), nullptr);
}

}  // namespace dtp::compat
