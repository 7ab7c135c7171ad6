// dtp-bench --device ... --profile DIR: one training step of dtp and one of
// plain libtorch under libtorch's Kineto profiler (libtorch 2.x): a Chrome
// trace of each (chrome://tracing, Perfetto) and a table of the host ops
// that cost the most time of their own (an op's time minus the ops it
// called: for a DTensor op, dtp's dispatch, propagation and redistribution).
#pragma once

#include <functional>
#include <string>

namespace dtp::bench {

// True where this libtorch has the Kineto API dtp-bench uses (2.x).
bool can_profile();

// Runs `step` once under the profiler (CPU ops, and CUDA kernels when `cuda`),
// writes the trace to `trace_path` and returns a Markdown table: the `top`
// ops by self host time, then the step's host time and, with `cuda`, the
// time its kernels kept the GPU busy.
std::string profile_step(const std::function<void()>& step, const std::string& trace_path, bool cuda, int top);

}  // namespace dtp::bench
