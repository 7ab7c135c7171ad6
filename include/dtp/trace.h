// TraceRecorder: a Chrome/Perfetto trace of what this thread runs, through
// libtorch's profiler: Kineto where the build has it (libtorch 2.x; with
// CUDA kernels when asked), else libtorch's legacy profiler (1.13: host
// spans). dtp's own spans are in it (NOTE: [Trace spans] in
// src/comm/trace_span.h): each DTensor op with its input and output
// placements, each redistribution, each collective with its bytes and ranks.
//
//   dtp::TraceRecorder trace;            // starts recording
//   train_step();
//   trace.export_chrome_trace("rank0.json");  // stops; open in ui.perfetto.dev
//                                             // or chrome://tracing
//
// One recorder at a time per process (libtorch's profilers are one per
// process); with ranks as threads, record on one of them.
#pragma once

#include <memory>
#include <string>

namespace dtp {

struct TraceOptions {
  bool cuda = false;  // also CUDA kernels and copies (Kineto only)
};

class TraceRecorder {
 public:
  explicit TraceRecorder(TraceOptions options = {});
  // Stops recording, without writing, if export_chrome_trace was not called.
  ~TraceRecorder();
  TraceRecorder(const TraceRecorder&) = delete;
  TraceRecorder& operator=(const TraceRecorder&) = delete;

  // Stops recording and writes the trace (Chrome's JSON trace format) to `path`.
  void export_chrome_trace(const std::string& path);
  // "kineto" or "legacy": which of libtorch's profilers records.
  static const char* backend();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtp
