// A latency histogram in Prometheus' shape (cumulative buckets, sum,
// count), for the engine's metrics (dtp-serve's /metrics): time to first token and inter-token
// latency.
#pragma once

#include <array>
#include <cstdint>
#include <sstream>
#include <string>

namespace dtp::inference {

class Histogram {
 public:
  // Upper bounds in seconds; +Inf is implied.
  static constexpr std::array<double, 12> kBounds = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                     0.1,   0.25,   0.5,   1.0,  2.5,   10.0};
  void observe(double seconds) {
    size_t i = 0;
    while (i < kBounds.size() && seconds > kBounds[i]) ++i;
    ++counts_[i];
    sum_ += seconds;
    ++count_;
  }
  int64_t count() const { return count_; }
  // `name`'s # HELP, # TYPE, _bucket{le=...} (cumulative), _sum and _count lines.
  std::string text(const std::string& name, const std::string& help) const {
    std::ostringstream o;
    o << "# HELP " << name << " " << help << "\n# TYPE " << name << " histogram\n";
    int64_t cumulative = 0;
    for (size_t i = 0; i <= kBounds.size(); ++i) {
      cumulative += counts_[i];
      o << name << "_bucket{le=\"";
      if (i < kBounds.size()) o << kBounds[i];
      else o << "+Inf";
      o << "\"} " << cumulative << "\n";
    }
    o << name << "_sum " << sum_ << "\n" << name << "_count " << count_ << "\n";
    return o.str();
  }

 private:
  std::array<int64_t, kBounds.size() + 1> counts_{};
  double sum_ = 0;
  int64_t count_ = 0;
};

}  // namespace dtp::inference
