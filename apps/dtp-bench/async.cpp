#include "async.h"

#include "stats.h"

#include "dtensor/redistribute.h"
#include "dtp/comm_counter.h"
#include "dtp/device_mesh.h"
#include "dtp/dtensor.h"
#include "dtp/models/parallelize.h"
#include "dtp/optim/adamw.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>

namespace dtp::bench {
namespace {

using namespace dtp::models;
using Clock = std::chrono::steady_clock;

// One side of the A/B: its step, its times, and what it computed and sent.
struct Side {
  const char* name;
  bool async;
  std::vector<double> ms;
  double first_loss = 0;
  std::string comm;  // CommCounter of the first step
};

double minOf(const std::vector<double>& v) { return v.empty() ? 0.0 : *std::min_element(v.begin(), v.end()); }

// Runs `step` for each side, A B A B, rep after rep; each time the slowest
// rank's. `step` returns the loss.
void interleave(Side (&sides)[2], int reps, int warmup, const ProcessGroup& world,
                const std::function<double(Side&)>& step) {
  for (int r = 0; r < warmup + reps; ++r) {
    for (Side& s : sides) {
      std::optional<SyncRedistributeScope> sync;
      if (!s.async) sync.emplace();
      std::optional<CommCounter> count;
      if (r == 0) count.emplace();
      double loss = 0;
      const double ms = timed_max(world, [&] { loss = step(s); });
      if (r == 0) {
        s.first_loss = loss;
        s.comm = count->str();
      }
      if (r >= warmup) s.ms.push_back(ms);
    }
  }
}

bool report(const char* what, Side (&sides)[2], const ProcessGroup& world) {
  const bool same = sides[0].first_loss == sides[1].first_loss && sides[0].comm == sides[1].comm;
  if (!same)
    std::fprintf(stderr, "dtp-bench --async: rank %d: %s: async and sync differ: loss %.9g vs %.9g, comm %s vs %s\n",
                 world.rank(), what, sides[0].first_loss, sides[1].first_loss, sides[0].comm.c_str(),
                 sides[1].comm.c_str());
  if (world.rank() == 0)
    std::printf("| %s | %.2f | %.2f | %.2f | %.2f | %.3f | %s |\n", what, minOf(sides[0].ms), median(sides[0].ms),
                minOf(sides[1].ms), median(sides[1].ms), median(sides[0].ms) / median(sides[1].ms),
                same ? "yes" : "NO");
  return same;
}

// (1) The reference Llama, TP over every rank with SP, forward + backward +
// AdamW: one model per side, the same weights.
bool runLlama(const Size& s, int reps, int warmup, const ProcessGroup& world) {
  const LlamaConfig c = s.config();
  const DeviceMesh mesh = init_device_mesh("cpu", {world.size()}, {"tp"});
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor batch = at::randint(c.vocab_size, {s.batch, s.seq + 1}, gen);
  const at::Tensor tokens = batch.narrow(1, 0, s.seq), targets = batch.narrow(1, 1, s.seq);
  Llama models[2] = {Llama(c), Llama(c)};
  std::unique_ptr<dtp::optim::AdamW> opts[2];
  for (int i = 0; i < 2; ++i) {
    apply_tensor_parallel(models[i], mesh, TensorParallelOptions{true, s.seq});
    opts[i] = std::make_unique<dtp::optim::AdamW>(models[i]->unique_parameters(), torch::optim::AdamWOptions(1e-3));
  }
  Side sides[2] = {{"async", true}, {"sync", false}};
  interleave(sides, reps, warmup, world, [&](Side& side) {
    const int i = side.async ? 0 : 1;
    opts[i]->zero_grad();
    at::Tensor loss = llama_loss(models[i](tokens), targets);
    loss.backward();
    opts[i]->step();
    return loss.item<double>();
  });
  return report((std::string("Llama ") + s.name + ", TP step (styles)").c_str(), sides, world);
}

// (2) Sequence-parallel input x [T/P, D] (S(0)) gathered to R for a column-
// parallel matmul with W [D, H/P], with an independent matmul of the same
// size (another branch's work) between the all_gather's issue and its use;
// backward through both.
bool runOverlap(const char* path, int reps, int warmup, const ProcessGroup& world) {
  constexpr int64_t T = 4096, D = 512, H = 256;  // 4 MiB per rank: the largest message the shm path takes by default
  const char* shm_env = std::getenv("DTP_SHM");
  const std::string shm_was = shm_env ? shm_env : "";
  if (std::string(path) == "gloo") setenv("DTP_SHM", "0", 1);
  const DeviceMesh mesh = init_device_mesh("cpu", {world.size()}, {"tp"});
  if (shm_env) setenv("DTP_SHM", shm_was.c_str(), 1); else unsetenv("DTP_SHM");
  const int P = world.size(), me = world.rank();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const at::Tensor x_full = at::randn({T, D}, gen), w_full = at::randn({D, H}, gen).div_(16);
  const at::Tensor a = at::randn({T, D}, gen), b = at::randn({D, H / P}, gen).div_(16);
  const at::Tensor x_mine = x_full.narrow(0, chunk_start(T, P, me), chunk_size(T, P, me));
  const at::Tensor w = distribute_tensor(w_full, mesh, {Shard(1)});
  Side sides[2] = {{"async", true}, {"sync", false}};
  interleave(sides, reps, warmup, world, [&](Side& side) {
    at::Tensor x = from_local(x_mine.clone().requires_grad_(true), mesh, {Shard(0)});
    at::Tensor wl = w.detach().requires_grad_(true);
    at::Tensor gathered = redistribute(x, mesh, {Replicate()}, side.async);  // issue
    at::Tensor other = at::mm(a, b.detach().requires_grad_(true)).relu();     // independent compute
    at::Tensor y = to_local(at::mm(gathered, wl));                            // use
    at::Tensor loss = y.square().mean() + other.square().mean();
    loss.backward();
    return loss.item<double>();
  });
  const std::string what = std::string("all_gather ") + std::to_string(T * D * 4 / P >> 10) + " KiB/rank over " +
                           path + ", then mm [" + std::to_string(T) + "x" + std::to_string(D) + "]x[" +
                           std::to_string(D) + "x" + std::to_string(H / P) + "] between issue and use";
  return report(what.c_str(), sides, world);
}

}  // namespace

bool run_async(const std::vector<const Size*>& sizes, int reps, int warmup, const ProcessGroup& world) {
  if (world.rank() == 0) {
    std::printf("\n## Async redistribution at TP=%d: async_op=true vs all synchronous, A B A B, %d reps "
                "(each the slowest rank's ms), %d threads per rank\n\n",
                world.size(), reps, at::get_num_threads());
    std::printf("| step | async min | async median | sync min | sync median | async / sync (medians) | same loss "
                "and collectives |\n|---|---|---|---|---|---|---|\n");
  }
  bool ok = true;
  for (const Size* s : sizes) ok &= runLlama(*s, reps, warmup, world);
  for (const char* path : {"shm", "gloo"}) ok &= runOverlap(path, reps, warmup, world);
  std::fflush(stdout);
  return ok;
}

}  // namespace dtp::bench
