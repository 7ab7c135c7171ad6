#include "moe.h"

#include "stats.h"

#include "dtp/device_mesh.h"
#include "dtp/dtensor.h"
#include "dtp/models/moe.h"
#include "dtp/tp/parallelize.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace dtp::bench {
namespace {

using models::MoE;
using models::MoEConfig;

constexpr int64_t kDim = 256, kHidden = 512, kExperts = 8, kTopK = 2;

MoE makeLayer(uint64_t seed) {
  MoEConfig c;
  c.num_experts = kExperts;
  c.top_k = kTopK;
  c.hidden = kHidden;
  MoE m(kDim, c);
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) p.set_data(at::normal(0.0, 0.05, p.sizes(), g));
  return m;
}

// Median ms over reps of `step` on every rank (the slowest rank's).
double timeIt(const ProcessGroup& world, int reps, int warmup, const std::function<void()>& step) {
  std::vector<double> ms;
  for (int r = 0; r < warmup + reps; ++r) {
    const double t = timed_max(world, step);
    if (r >= warmup) ms.push_back(t);
  }
  return median(ms);
}

}  // namespace

bool run_moe(int reps, int warmup, const ProcessGroup& world) {
  const int P = world.size(), me = world.rank();
  TORCH_CHECK(kExperts % P == 0, "dtp-bench --moe: ", kExperts, " experts over ", P, " ranks: use 1, 2, 4 or 8 ranks.");
  DeviceMesh mesh = init_device_mesh("cpu", {P}, {"ep"});
  MoE one = makeLayer(1), ep = makeLayer(1), cut = makeLayer(1);
  models::distribute_experts(*ep, mesh);
  // TP inside the experts: every rank all ranks' tokens, 1/P of each
  // expert's hidden units, the output all-reduced.
  const DeviceMesh tp = init_device_mesh("cpu", {P}, {"tp"});
  parallelize_module(*cut, tp, {{"experts", models::ExpertTensorParallel()}});
  bool ok = true;
  if (me == 0) {
    std::printf("dtp-bench --moe: %d ranks (ep), dim %lld, %lld experts of %lld, top-%lld, %d threads per rank\n\n", P,
                static_cast<long long>(kDim), static_cast<long long>(kExperts), static_cast<long long>(kHidden),
                static_cast<long long>(kTopK), at::get_num_threads());
    std::printf("| pass | tokens per rank | one device, all ranks' tokens (ms) | EP over %d ranks (ms) | TP inside the "
                "experts (ms) | EP tokens/s | one device tokens/s | EP / one device | TP inside / one device |\n"
                "|---|---|---|---|---|---|---|---|---|\n", P);
  }
  for (bool train : {true, false}) {
    for (int64_t tokens : train ? std::vector<int64_t>{512, 2048} : std::vector<int64_t>{1, 8}) {
      at::Generator g = at::make_generator<at::CPUGeneratorImpl>(2);
      const at::Tensor all = at::randn({P, tokens, kDim}, g);
      const at::Tensor mine = all.narrow(0, me, 1);
      auto pass = [&](MoE& m, const at::Tensor& x) {
        if (!train) {
          torch::NoGradGuard no_grad;
          return m(x);
        }
        at::Tensor in = x.clone().requires_grad_(true);
        at::Tensor y = m(in);
        y.sum().backward();
        return y.detach();
      };
      // One device: rank 0 runs every rank's tokens; the others wait.
      const double one_ms = timeIt(world, reps, warmup, [&] {
        if (me == 0) pass(one, all);
      });
      const double ep_ms = timeIt(world, reps, warmup, [&] { pass(ep, mine); });
      auto cutPass = [&] {
        at::Tensor in = from_local(all, tp, {Replicate()}, /*run_check=*/false);
        if (!train) {
          torch::NoGradGuard no_grad;
          return to_local(redistribute(cut(in), tp, {Replicate()}));
        }
        at::Tensor x = all.clone().requires_grad_(true);
        at::Tensor y = to_local(redistribute(cut(from_local(x, tp, {Replicate()}, false)), tp, {Replicate()}));
        y.sum().backward();
        return y.detach();
      };
      const double cut_ms = timeIt(world, reps, warmup, [&] { cutPass(); });
      // The checks: EP's rows equal one device's rows of this rank, TP's all.
      const at::Tensor want = pass(one, all);
      const double diff = std::max((pass(ep, mine) - want.narrow(0, me, 1)).abs().max().item<double>(),
                                   (cutPass() - want).abs().max().item<double>());
      if (diff > 1e-4) {
        ok = false;
        std::printf("dtp-bench --moe: rank %d: EP or TP inside the experts differs from one device by %.3g\n", me, diff);
      }
      if (me == 0) {
        const double n = static_cast<double>(P * tokens);
        std::printf("| %s | %lld | %.3f | %.3f | %.3f | %.0f | %.0f | %.2fx | %.2fx |\n",
                    train ? "train (fwd+bwd)" : "decode (fwd)", static_cast<long long>(tokens), one_ms, ep_ms, cut_ms,
                    n / ep_ms * 1e3, n / one_ms * 1e3, one_ms / ep_ms, one_ms / cut_ms);
      }
    }
  }
  // The dispatch alone: every rank sends tokens * top_k rows of dim floats,
  // evenly to every rank, through shared memory (where every rank's rows fit
  // a slot, DTP_SHM_MAX_BYTES; else it declines to Gloo) and through Gloo
  // alone (a group made with DTP_SHM=0), side by side; both give the same rows.
  if (me == 0)
    std::printf("\n| all_to_all_single: rows each rank sends (evenly to all) | bytes per rank | shm ms | gloo ms | gloo / "
                "shm |\n|---|---|---:|---:|---:|\n");
  const ProcessGroup group = mesh.get_group(0);
  std::vector<int> everyone(P);
  for (int r = 0; r < P; ++r) everyone[r] = r;
  const char* shm_env = std::getenv("DTP_SHM");
  const std::string shm_was = shm_env ? shm_env : "";
  setenv("DTP_SHM", "0", 1);
  const ProcessGroup gloo = world.new_group(everyone);
  if (shm_env) setenv("DTP_SHM", shm_was.c_str(), 1); else unsetenv("DTP_SHM");
  for (int64_t rows : {8, 512, 4096}) {
    const at::Tensor x = at::randn({rows * P, kDim});
    const std::vector<int64_t> split(P, rows);
    const double shm_ms = timeIt(world, reps, warmup, [&] { group.all_to_all_single(x, split, split).wait(); });
    const double gloo_ms = timeIt(world, reps, warmup, [&] { gloo.all_to_all_single(x, split, split).wait(); });
    if (!group.all_to_all_single(x, split, split).wait().equal(gloo.all_to_all_single(x, split, split).wait())) {
      ok = false;
      std::printf("dtp-bench --moe: rank %d: all_to_all_single through shared memory differs from Gloo's\n", me);
    }
    if (me == 0)
      std::printf("| %lld | %lld | %.3f | %.3f | %.2fx |\n", static_cast<long long>(rows * P),
                  static_cast<long long>(x.numel() * 4), shm_ms, gloo_ms, gloo_ms / shm_ms);
  }
  std::fflush(stdout);
  return ok;
}

}  // namespace dtp::bench
