// dtp-train --metrics FILE: one JSON object per logged step, one per line
// (JSON Lines), written by rank 0 and flushed as it goes, so a plot of a run
// still in progress reads what is there (scripts/plot.sh FILE).
#pragma once

#include <cmath>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

namespace dtp {
class CommDebugMode;  // dtp/comm_counter.h
class ProcessGroup;   // dtp/process_group.h
}  // namespace dtp

namespace dtp::apps {

// What one logged step reports. Rates and per-step figures are over the steps
// since the previous logged step.
struct StepMetrics {
  int64_t step = 0;                  // optimizer steps done
  double loss = 0;                   // this step's loss (averaged over dp)
  double tokens_per_s = 0;           // tokens trained per second, all ranks together
  double step_ms = 0;                // wall time per step
  double peak_rss_mib = 0;           // peak resident memory, max over ranks
  double collectives_per_step = 0;   // this rank's collectives per step
  double comm_bytes_per_step = 0;    // this rank's collective bytes per step
  double grad_norm = 0;              // total gradient norm (before clipping)
  double lr = 0;                     // learning rate of this step
  // MoE models (--experts): this step's load-balancing loss (included in
  // `loss`; averaged over dp) and the routed token slots per expert, summed
  // over layers and dp ranks (each token counts top_k times per layer).
  double aux_loss = std::nan("");
  std::vector<int64_t> tokens_per_expert;
};

class MetricsWriter {
 public:
  // No file when `path` is empty: write() does nothing.
  explicit MetricsWriter(const std::string& path);
  bool enabled() const { return out_.is_open(); }
  void write(const StepMetrics& m);

 private:
  std::string path_;
  std::ofstream out_;
};

// --comm-debug FILE: one JSON object per rank, in rank order (rank 0 writes
// it); collective over `world`.
void write_comm_debug(const CommDebugMode& debug, const std::string& path, const ProcessGroup& world);

}  // namespace dtp::apps
