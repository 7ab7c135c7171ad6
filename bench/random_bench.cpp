// Dropout on a DTensor at TP=2, RandomMode::Global against RandomMode::PerShard
// (#57 item 6), side by side in one run: time per call and peak memory per
// rank. Each mode runs in its own pair of rank processes (Gloo over a
// FileStore), so that each process's peak RSS is one rank's in one mode:
//   Global    every rank draws the whole [rows, cols] mask and keeps its rows
//             (O(global) time, a full temporary);
//   PerShard  every rank draws its own rows only (Philox: NOTE: [Per-shard
//             random numbers] in src/dtensor/philox.h).
// The input is f32[rows, cols](S(0)), made from local shards (no global
// tensor). A rank reports the median time of --reps calls (after one warm-up
// call), its peak RSS and the peak above its RSS before the first call; it
// checks the kept fraction (1 - p within 5 standard deviations) and exits 1
// otherwise.
//
//   dtp_random_bench [--rows 8192] [--cols 8192] [--p 0.1] [--reps 5] [--threads 1]
#include "dtp/device_mesh.h"
#include "dtp/dtensor.h"
#include "dtp/process_group.h"
#include "dtp/random.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace {

struct Options {
  int64_t rows = 8192, cols = 8192, reps = 5, threads = 1;
  double p = 0.1;
};

double rssMiB() {  // current resident set
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1 << 20);
}

double peakRssMiB() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024.0;  // KiB on Linux
}

// One rank of one mode; prints its line and returns the exit status.
int rank(const Options& o, dtp::RandomMode mode, int r, const std::string& store_path) {
  at::set_num_threads(static_cast<int>(o.threads));
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, 2);
  dtp::set_default_process_group(dtp::ProcessGroup::create(store, r, 2));
  auto mesh = dtp::init_device_mesh("cpu", {2});
  dtp::manual_seed(1234);
  dtp::set_random_mode(mode);
  const int64_t local_rows = o.rows / 2 + (r < o.rows % 2 ? 1 : 0);
  at::Tensor local = at::ones({local_rows, o.cols}, at::kFloat);
  at::Tensor x = dtp::from_local(local, mesh, {dtp::Shard(0)});
  const double rss_before = rssMiB();
  std::vector<double> ms;
  at::Tensor y;
  for (int64_t i = 0; i <= o.reps; ++i) {
    y = at::Tensor();  // the previous output is not held during the call
    mesh.get_group(0).barrier();
    const auto t0 = std::chrono::steady_clock::now();
    y = at::dropout(x, o.p, /*train=*/true);
    const auto t1 = std::chrono::steady_clock::now();
    if (i > 0) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  const double peak = peakRssMiB();  // before the check below allocates
  std::sort(ms.begin(), ms.end());
  const double kept = static_cast<double>(dtp::to_local(y).ne(0).sum().item<int64_t>()) / local.numel();
  std::printf("%-8s rank %d  %9.1f ms/call  peak RSS %7.0f MiB  (+%6.0f MiB over %6.0f MiB before the first call)"
              "  kept %.4f\n",
              mode == dtp::RandomMode::Global ? "Global" : "PerShard", r, ms[ms.size() / 2], peak,
              peak - rss_before, rss_before, kept);
  std::fflush(stdout);
  dtp::set_default_process_group(dtp::ProcessGroup());
  const double sd = std::sqrt(o.p * (1 - o.p) / static_cast<double>(local.numel()));
  return std::abs(kept - (1 - o.p)) <= 5 * sd + 1e-12 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const char* v = argv[i + 1];
    if (k == "--rows") o.rows = std::atoll(v);
    else if (k == "--cols") o.cols = std::atoll(v);
    else if (k == "--p") o.p = std::atof(v);
    else if (k == "--reps") o.reps = std::atoll(v);
    else if (k == "--threads") o.threads = std::atoll(v);
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  std::printf("dropout(p=%.2f) on f32[%lld,%lld](S(0)), TP=2 (2 processes, %lld intra-op thread(s) each), "
              "median of %lld calls\n",
              o.p, static_cast<long long>(o.rows), static_cast<long long>(o.cols), static_cast<long long>(o.threads),
              static_cast<long long>(o.reps));
  std::fflush(stdout);
  int status = 0;
  for (dtp::RandomMode mode : {dtp::RandomMode::Global, dtp::RandomMode::PerShard}) {
    char path[] = "/tmp/dtp_random_bench_XXXXXX";
    const int fd = mkstemp(path);
    close(fd);
    unlink(path);  // FileStore makes it
    pid_t pids[2];
    for (int r = 0; r < 2; ++r) {
      pids[r] = fork();
      if (pids[r] == 0) _exit(rank(o, mode, r, path));  // before the parent touches torch
    }
    for (pid_t pid : pids) {
      int st = 0;
      waitpid(pid, &st, 0);
      if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) status = 1;
    }
    unlink(path);
  }
  return status;
}
