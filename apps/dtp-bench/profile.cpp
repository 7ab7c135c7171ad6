#include "profile.h"

#include "comm/compat.h"

#include <c10/util/Exception.h>

#if DTP_HAS_KINETO
#include <torch/csrc/autograd/profiler_kineto.h>
#endif

#include <algorithm>
#include <cstdio>
#include <map>
#include <vector>

namespace dtp::bench {

#if DTP_HAS_KINETO

bool can_profile() { return true; }

namespace {

struct Span {
  std::string name;
  uint64_t start, end, thread;
};

struct Cost {
  uint64_t self = 0, total = 0, calls = 0;
};

}  // namespace

std::string profile_step(const std::function<void()>& step, const std::string& trace_path, bool cuda, int top) {
  namespace prof = torch::profiler::impl;
  std::set<prof::ActivityType> activities{prof::ActivityType::CPU};
  if (cuda) activities.insert(prof::ActivityType::CUDA);
  const prof::ProfilerConfig config(prof::ProfilerState::KINETO);
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
  try {
    step();
  } catch (...) {
    torch::autograd::profiler::disableProfiler();
    throw;
  }
  std::unique_ptr<torch::autograd::profiler::ProfilerResult> result = torch::autograd::profiler::disableProfiler();
  result->save(trace_path);

  // Self time: each host span minus the spans nested directly inside it on its thread.
  std::vector<Span> spans;
  uint64_t gpu_busy = 0, first = UINT64_MAX, last = 0;
  for (const auto& e : result->events()) {
    if (e.deviceType() == c10::DeviceType::CUDA) {
      gpu_busy += e.durationNs();
      continue;
    }
    if (e.endNs() <= e.startNs() || e.isAsync()) continue;
    spans.push_back({e.name(), e.startNs(), e.endNs(), e.startThreadId()});
    first = std::min(first, e.startNs());
    last = std::max(last, e.endNs());
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.thread != b.thread ? a.thread < b.thread : a.start != b.start ? a.start < b.start : a.end > b.end;
  });
  std::map<std::string, Cost> costs;
  std::vector<std::pair<const Span*, uint64_t>> open;  // span, time of its children so far
  auto close = [&] {
    const auto [s, children] = open.back();
    open.pop_back();
    Cost& c = costs[s->name];
    c.total += s->end - s->start;
    c.self += (s->end - s->start) - std::min(children, s->end - s->start);
    c.calls += 1;
    if (!open.empty()) open.back().second += s->end - s->start;
  };
  for (size_t i = 0; i < spans.size(); ++i) {
    if (i > 0 && spans[i].thread != spans[i - 1].thread)
      while (!open.empty()) close();
    while (!open.empty() && open.back().first->end <= spans[i].start) close();
    open.push_back({&spans[i], 0});
  }
  while (!open.empty()) close();

  std::vector<std::pair<std::string, Cost>> rows(costs.begin(), costs.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.self > b.second.self; });
  std::string out = "| host op | calls | self ms | total ms |\n|---|---:|---:|---:|\n";
  char line[512];
  uint64_t self_sum = 0;
  for (const auto& r : rows) self_sum += r.second.self;
  for (size_t i = 0; i < rows.size() && static_cast<int>(i) < top; ++i) {
    std::snprintf(line, sizeof line, "| %s | %llu | %.3f | %.3f |\n", rows[i].first.c_str(),
                  static_cast<unsigned long long>(rows[i].second.calls), rows[i].second.self / 1e6,
                  rows[i].second.total / 1e6);
    out += line;
  }
  std::snprintf(line, sizeof line, "\nhost: %.3f ms from the first op to the last, %.3f ms inside ops (self times summed)",
                spans.empty() ? 0.0 : (last - first) / 1e6, self_sum / 1e6);
  out += line;
  if (cuda) {
    std::snprintf(line, sizeof line, "; GPU busy %.3f ms", gpu_busy / 1e6);
    out += line;
  }
  return out + "\n";
}

#else

bool can_profile() { return false; }

std::string profile_step(const std::function<void()>&, const std::string&, bool, int) {
  TORCH_CHECK(false, "dtp-bench --profile needs libtorch 2.x (Kineto's C++ API); this is libtorch ", TORCH_VERSION);
}

#endif

}  // namespace dtp::bench
