// NOTE: [Trace spans]
// What dtp does shows in profilers as named spans: libtorch's RecordFunction
// (USER_SCOPE), which libtorch's profilers (Kineto on 2.x, the legacy one on
// 1.13; dtp::TraceRecorder starts either) record around the op spans the
// dispatcher already emits. Three kinds, nested:
//   "DTensor aten::mm (S(0), R) -> (S(0))"        an op on DTensors, after propagation
//   "redistribute f32[8,16] (S(0)) -> (R)"       a change of placements
//   "all_gather 512 B over ranks [0, 1]"         a collective (synchronous part;
//                                                an async one's wait is outside)
// With no profiler listening a span costs one at::hasCallbacks() check; its
// name (placements, bytes) is built only when one listens.
#pragma once

#include <ATen/record_function.h>

#include <optional>
#include <string>

namespace dtp::detail {

class TraceSpan {
 public:
  // `name` is called (returning a std::string) only when a profiler listens.
  template <typename NameFn>
  explicit TraceSpan(NameFn&& name) {
    if (!at::hasCallbacks()) return;
    span_.emplace(at::RecordScope::USER_SCOPE);
    if (span_->isActive()) span_->before(std::string(name()));
  }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  std::optional<at::RecordFunction> span_;
};

}  // namespace dtp::detail
