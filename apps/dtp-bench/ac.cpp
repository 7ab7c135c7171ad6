#include "ac.h"

#include "memory.h"
#include "stats.h"

#include "dtp/device_mesh.h"
#include "dtp/models/parallelize.h"
#include "dtp/optim/adamw.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>

namespace dtp::bench {
namespace {

using namespace dtp::models;
using Clock = std::chrono::steady_clock;

struct Variant {
  const char* name;
  std::optional<ACMode> mode;
  Llama model{nullptr};
  std::unique_ptr<dtp::optim::AdamW> opt;
  std::vector<double> ms;
  int64_t after_forward = 0, peak = 0;  // bytes beyond what lived before the step
  double first_loss = 0;
};

bool runSize(const Size& s, int reps, int warmup, const ProcessGroup& world) {
  const LlamaConfig c = s.config();
  DeviceMesh mesh = init_device_mesh("cpu", {world.size()}, {"tp"});
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor batch = at::randint(c.vocab_size, {s.batch, s.seq + 1}, gen);
  const at::Tensor tokens = batch.narrow(1, 0, s.seq), targets = batch.narrow(1, 1, s.seq);
  std::vector<Variant> vs(3);
  vs[0].name = "none";
  vs[1].name = "full";
  vs[1].mode = ACMode::Full;
  vs[2].name = "selective";
  vs[2].mode = ACMode::Selective;
  for (auto& v : vs) {
    v.model = Llama(c);
    apply_tensor_parallel(v.model, mesh, TensorParallelOptions{true, s.seq});
    if (v.mode) apply_ac(v.model, ACOptions{*v.mode, 1});
    v.opt = std::make_unique<dtp::optim::AdamW>(v.model->unique_parameters(), torch::optim::AdamWOptions(1e-3));
  }
  std::vector<size_t> order(vs.size());
  std::iota(order.begin(), order.end(), 0);
  std::mt19937 shuffler(13);
  for (int r = 0; r < warmup + reps; ++r) {
    std::shuffle(order.begin(), order.end(), shuffler);
    for (size_t i : order) {
      Variant& v = vs[i];
      v.opt->zero_grad();
      world.barrier();
      const int64_t before = live_bytes();
      reset_peak();
      const auto t0 = Clock::now();
      at::Tensor loss = llama_loss(v.model(tokens), targets);
      const int64_t after_forward = live_bytes() - before;
      loss.backward();
      v.opt->step();
      const double l = loss.item<double>();
      at::Tensor ms = at::full({1}, std::chrono::duration<double, std::milli>(Clock::now() - t0).count(), at::kDouble);
      world.all_reduce(ms, ReduceOp::Max);
      if (r == 0) v.first_loss = l;
      if (r >= warmup) v.ms.push_back(ms.item<double>());
      v.after_forward = after_forward;
      v.peak = peak_bytes() - before;
    }
  }
  bool ok = true;
  for (const auto& v : vs) {
    if (std::abs(v.first_loss - vs[0].first_loss) > 1e-6) {
      std::fprintf(stderr, "dtp-bench: %s AC %s first loss %.7f differs from no AC's %.7f\n", s.name, v.name,
                   v.first_loss, vs[0].first_loss);
      ok = false;
    }
  }
  if (world.rank() == 0) {
    const double base = median(vs[0].ms);
    for (const auto& v : vs)
      std::printf("| %s | %s | %.2f | %.3f | %.2f | %.2f |\n", s.name, v.name, median(v.ms), median(v.ms) / base,
                  v.after_forward / kMiB, v.peak / kMiB);
  }
  return ok;
}

}  // namespace

bool run_ac(const std::vector<const Size*>& sizes, int reps, int warmup, const ProcessGroup& world) {
  if (world.rank() == 0) {
    std::printf("\n## Activation checkpointing at TP=%d with SP, every block; median of %d reps\n\n", world.size(),
                reps);
    std::printf("Memory per rank (rank 0) beyond what lived before the step: live at the end of forward "
                "(activations kept for backward), and the peak during forward, backward and the optimizer step.\n\n");
    std::printf("| size | AC | step ms | / no AC | live after forward MiB | peak in step MiB |\n");
    std::printf("|---|---|---|---|---|---|\n");
  }
  bool ok = true;
  for (const Size* s : sizes) ok &= runSize(*s, reps, warmup, world);
  return ok;
}

}  // namespace dtp::bench
