#include "metrics.h"

#include "dtp/comm_counter.h"
#include "dtp/process_group.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>

namespace dtp::apps {

MetricsWriter::MetricsWriter(const std::string& path) : path_(path) {
  if (path.empty()) return;
  out_.open(path, std::ios::trunc);
  TORCH_CHECK(out_.is_open(), "dtp-train --metrics: cannot write ", path, ". Give a path in a writable folder.");
}

namespace {

// A JSON number, or null for what JSON cannot say (a diverged loss: nan, inf).
std::string number(double x, const char* format) {
  if (!std::isfinite(x)) return "null";
  char text[64];
  std::snprintf(text, sizeof text, format, x);
  return text;
}

}  // namespace

void MetricsWriter::write(const StepMetrics& m) {
  if (!enabled()) return;
  out_ << "{\"step\": " << m.step << ", \"loss\": " << number(m.loss, "%.6f")
       << ", \"tokens_per_s\": " << number(m.tokens_per_s, "%.1f") << ", \"step_ms\": " << number(m.step_ms, "%.3f")
       << ", \"peak_rss_mib\": " << number(m.peak_rss_mib, "%.1f")
       << ", \"collectives_per_step\": " << number(m.collectives_per_step, "%.2f")
       << ", \"comm_bytes_per_step\": " << number(m.comm_bytes_per_step, "%.0f")
       << ", \"grad_norm\": " << number(m.grad_norm, "%.6g") << ", \"lr\": " << number(m.lr, "%.6g");
  if (!m.tokens_per_expert.empty()) {
    out_ << ", \"aux_loss\": " << number(m.aux_loss, "%.6g") << ", \"tokens_per_expert\": [";
    for (size_t e = 0; e < m.tokens_per_expert.size(); ++e) out_ << (e ? ", " : "") << m.tokens_per_expert[e];
    out_ << "]";
  }
  out_ << "}\n";
  out_.flush();
  TORCH_CHECK(out_.good(), "dtp-train --metrics: writing ", path_, " failed (disk full?).");
}

// One JSON object per rank, in rank order, to `path` (rank 0 writes it): the
// ranks' collectives can differ (uneven shards, different groups).
void write_comm_debug(const CommDebugMode& debug, const std::string& path, const ProcessGroup& world) {
  const std::string mine = debug.to_json();
  at::Tensor bytes = at::from_blob(const_cast<char*>(mine.data()), {static_cast<int64_t>(mine.size())}, at::kChar).clone();
  at::Tensor size = at::full({1}, bytes.numel(), at::kLong);
  std::vector<int64_t> sizes(world.size(), 0);
  at::Tensor all_sizes = world.all_gather(size, 0, std::vector<int64_t>(world.size(), 1)).wait();
  for (int r = 0; r < world.size(); ++r) sizes[r] = all_sizes[r].item<int64_t>();
  at::Tensor all = world.all_gather(bytes, 0, sizes).wait();
  if (world.rank() != 0) return;
  std::ofstream out(path);
  TORCH_CHECK(out, "--comm-debug: cannot write ", path, ".");
  out << "{\"ranks\": [";
  int64_t at = 0;
  for (int r = 0; r < world.size(); ++r) {
    out << (r ? ",\n" : "\n") << std::string(static_cast<const char*>(all.data_ptr()) + at, sizes[r]);
    at += sizes[r];
  }
  out << "\n]}\n";
  TORCH_CHECK(out.good(), "--comm-debug: writing ", path, " failed.");
  std::printf("comm-debug: the first step's collectives per module, pass and op in %s\n", path.c_str());
}

}  // namespace dtp::apps
