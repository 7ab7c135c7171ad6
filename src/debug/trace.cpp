#include "dtp/trace.h"

#include "comm/compat.h"

#include <c10/util/Exception.h>

#include <fstream>

#if DTP_HAS_KINETO
#include <torch/csrc/autograd/profiler_kineto.h>
#else
#include <torch/csrc/autograd/profiler_legacy.h>

#include <sstream>
#endif

namespace dtp {

#if DTP_HAS_KINETO

struct TraceRecorder::Impl {
  bool recording = false;
};

TraceRecorder::TraceRecorder(TraceOptions options) : impl_(std::make_unique<Impl>()) {
  namespace prof = torch::profiler::impl;
  std::set<prof::ActivityType> activities{prof::ActivityType::CPU};
  if (options.cuda) activities.insert(prof::ActivityType::CUDA);
  const prof::ProfilerConfig config(prof::ProfilerState::KINETO);
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
  impl_->recording = true;
}

TraceRecorder::~TraceRecorder() {
  if (!impl_->recording) return;
  try {
    torch::autograd::profiler::disableProfiler();
  } catch (...) {  // a destructor must not throw; the trace is dropped anyway
  }
}

void TraceRecorder::export_chrome_trace(const std::string& path) {
  TORCH_CHECK(impl_->recording, "TraceRecorder: export_chrome_trace called twice; a recorder records once.");
  impl_->recording = false;
  auto result = torch::autograd::profiler::disableProfiler();
  TORCH_CHECK(std::ofstream(path).good(), "TraceRecorder: cannot write the trace to ", path,
              ". Give a path in a writable folder.");
  result->save(path);
}

const char* TraceRecorder::backend() { return "kineto"; }

#else

// libtorch 1.13 has Kineto's C++ API only in part; its legacy profiler
// writes the same Chrome trace format when its RecordProfile ends.
struct TraceRecorder::Impl {
  std::ostringstream trace;
  std::unique_ptr<torch::autograd::profiler::RecordProfile> profile;
};

TraceRecorder::TraceRecorder(TraceOptions options) : impl_(std::make_unique<Impl>()) {
  TORCH_CHECK(!options.cuda, "TraceRecorder: NYI: CUDA kernels in the trace need libtorch 2.x's Kineto profiler; "
              "this is libtorch ", TORCH_VERSION, ". Record host spans only (TraceOptions{}).");
  impl_->profile = std::make_unique<torch::autograd::profiler::RecordProfile>(impl_->trace);
}

TraceRecorder::~TraceRecorder() = default;

void TraceRecorder::export_chrome_trace(const std::string& path) {
  TORCH_CHECK(impl_->profile, "TraceRecorder: export_chrome_trace called twice; a recorder records once.");
  impl_->profile.reset();  // stops the profiler and writes the trace
  std::ofstream out(path);
  TORCH_CHECK(out.good(), "TraceRecorder: cannot write the trace to ", path, ". Give a path in a writable folder.");
  out << impl_->trace.str();
  TORCH_CHECK(out.good(), "TraceRecorder: writing ", path, " failed (disk full?).");
}

const char* TraceRecorder::backend() { return "legacy"; }

#endif

}  // namespace dtp
