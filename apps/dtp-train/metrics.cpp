#include "metrics.h"

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

}  // namespace dtp::apps
