#include "collectives.h"

#include "groups.h"
#include "stats.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <string>

namespace dtp::bench {
namespace {

std::string sizeText(int64_t b) {
  return b >= (1 << 20) ? std::to_string(b >> 20) + " MiB" : std::to_string(b >> 10) + " KiB";
}

}  // namespace

bool run_collectives(const CollectiveOptions& o, const ProcessGroup& world) {
  const int w = world.size();
  const int64_t largest = *std::max_element(o.sizes.begin(), o.sizes.end());
  ProcessGroup gloo = whole_group_with(world, "0");
  ProcessGroup shm = whole_group_with(world, "1", std::to_string(std::max<int64_t>(largest, 4096)));
  // Ranks on several hosts (LOCAL_WORLD_SIZE < WORLD_SIZE, as dtprun --nnodes
  // and torchrun set them): the second path is the two-level one (NOTE:
  // [Two-level collectives] in src/comm/two_level.cpp), against flat Gloo.
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  const int per_host = local != nullptr ? std::max(std::atoi(local), 1) : w;
  const bool hosts = per_host < w;
  if (world.rank() == 0) {
    if (hosts)
      std::printf("\n## CPU collectives, %d ranks on %d hosts (%d per host): microseconds per call (median of %d reps, "
                  "each the mean of a timed loop; slowest rank), float32; flat Gloo (DTP_SHM=0) against two-level "
                  "(shared memory within each host, Gloo between one leader per host)\n\n",
                  w, w / per_host, per_host, o.reps);
    else
      std::printf("\n## CPU collectives, %d ranks on one host: microseconds per call (median of %d reps, each the "
                  "mean of a timed loop; slowest rank), float32\n\n",
                  w, o.reps);
    std::printf("size: the all_reduce tensor, the all_gather output, the reduce_scatter input. GB/s: size / time.\n\n");
    std::printf(hosts ? "| collective | size | flat gloo us | two-level us | flat gloo GB/s | two-level GB/s | flat / two-level |\n"
                      : "| collective | size | gloo us | shm us | gloo GB/s | shm GB/s | gloo / shm |\n");
    std::printf("|---|---|---:|---:|---:|---:|---:|\n");
  }
  bool ok = true;
  const char* names[] = {"all_reduce", "all_gather", "reduce_scatter"};
  std::string crossovers;
  for (int kind = 0; kind < 3; ++kind) {
    int64_t crossover = 0;
    for (int64_t bytes : o.sizes) {
      const int64_t numel = std::max<int64_t>(bytes / 4 / w, 1) * w;  // divisible by the group size
      const at::Tensor x = at::arange(numel, at::kFloat).mul_(world.rank() + 1).div_(numel);
      std::vector<int64_t> sizes(w, numel / w);
      auto call = [&](const ProcessGroup& g) {
        switch (kind) {
          case 0: return g.all_reduce(x.clone()).wait();
          case 1: return g.all_gather(x.narrow(0, world.rank() * (numel / w), numel / w), 0, sizes).wait();
          default: return g.reduce_scatter(x, 0, sizes).wait();
        }
      };
      const bool same = at::allclose(call(gloo), call(shm), 1e-6, 1e-6);
      if (!same && world.rank() == 0)
        std::fprintf(stderr, "dtp-bench --collectives: %s of %s: the shared-memory result differs from Gloo's\n",
                     names[kind], sizeText(bytes).c_str());
      ok &= same;
      // Enough calls per loop for ~20 ms on Gloo, at least 2.
      const double probe = timed_max(world, [&] { call(gloo); });
      const int iters = std::clamp(static_cast<int>(20.0 / std::max(probe, 1e-3)), 2, 2000);
      std::vector<double> us[2];
      for (int r = 0; r < o.reps; ++r)
        for (int p : r % 2 == 0 ? std::vector<int>{0, 1} : std::vector<int>{1, 0})
          us[p].push_back(timed_max(world, [&] {
                            for (int i = 0; i < iters; ++i) call(p == 0 ? gloo : shm);
                          }) * 1000.0 / iters);
      const double g = median(us[0]), s = median(us[1]);
      if (s < g) crossover = bytes;
      if (world.rank() == 0)
        std::printf("| %s | %s | %.1f | %.1f | %.3f | %.3f | %.2f |\n", names[kind], sizeText(bytes).c_str(), g, s,
                    bytes / g / 1e3, bytes / s / 1e3, g / s);
      std::fflush(stdout);
    }
    crossovers += std::string(crossovers.empty() ? "" : ", ") + names[kind] + " " +
                  (crossover == 0 ? "never" : sizeText(crossover));
  }
  if (world.rank() == 0)
    std::printf(hosts ? "\nTwo-level wins up to (largest size measured where it is faster): %s\n"
                      : "\nShared memory wins up to (largest size measured where it is faster): %s\n",
                crossovers.c_str());
  return ok;
}

}  // namespace dtp::bench
