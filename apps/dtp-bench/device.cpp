#include "device.h"

#include "profile.h"
#include "stats.h"

#include "dtp/device_mesh.h"
#include "dtp/models/parallelize.h"
#include "dtp/optim/adamw.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <numeric>
#include <random>

namespace dtp::bench {
namespace {

using namespace dtp::models;

struct Variant {
  const char* name;
  bool all_ranks;
  std::function<double()> step;  // one training step; its loss (read on the host: the step's end)
  std::vector<double> ms;
  double first_loss = 0;
  int64_t dtensor_ops = 0;  // per step on rank 0
};

bool runSize(const Size& s, const std::string& device_type, const std::vector<bool>& sps, int reps, int warmup,
             const ProcessGroup& world, const std::string& profile_dir, std::string& profiles) {
  DeviceMesh mesh = init_device_mesh(device_type, {world.size()}, {"tp"});
  LlamaConfig c = s.config();
  c.device = mesh.device();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor batch = at::randint(c.vocab_size, {s.batch, s.seq + 1}, gen).to(c.device);
  const at::Tensor tokens = batch.narrow(1, 0, s.seq), targets = batch.narrow(1, 1, s.seq);

  std::vector<Llama> dtp_models;
  std::vector<std::unique_ptr<dtp::optim::AdamW>> dtp_opts;
  for (bool sp : sps) {
    dtp_models.emplace_back(c);
    apply_tensor_parallel(dtp_models.back(), mesh, TensorParallelOptions{sp, s.seq});
    dtp_opts.push_back(std::make_unique<dtp::optim::AdamW>(dtp_models.back()->unique_parameters(),
                                                           torch::optim::AdamWOptions(1e-3)));
  }
  Llama plain(c);
  torch::optim::AdamW plain_opt(plain->unique_parameters(), torch::optim::AdamWOptions(1e-3));
  auto step = [&](Llama& m, torch::optim::Optimizer& opt) {
    opt.zero_grad();
    at::Tensor loss = llama_loss(m(tokens), targets);
    loss.backward();
    opt.step();
    return loss.item<double>();
  };
  std::vector<Variant> vs;
  for (size_t i = 0; i < sps.size(); ++i)
    vs.push_back({sps[i] ? "yes" : "no", true, [&, i] { return step(dtp_models[i], *dtp_opts[i]); }});
  vs.push_back({"plain", false, [&] { return step(plain, plain_opt); }});
  std::vector<size_t> order(vs.size());
  std::iota(order.begin(), order.end(), 0);
  std::mt19937 shuffler(17);  // the same orders on every rank
  for (int r = 0; r < warmup + reps; ++r) {
    std::shuffle(order.begin(), order.end(), shuffler);
    for (size_t k : order) {
      Variant& v = vs[k];
      const double ms = timed_max(world, [&] {
        if (!v.all_ranks && world.rank() != 0) return;
        const DTensorOpCounter ops;
        const double l = v.step();
        v.dtensor_ops = ops.ops();
        if (r == 0) v.first_loss = l;
      });
      if (r >= warmup) v.ms.push_back(ms);
    }
  }
  for (Variant& v : vs) {
    if (profile_dir.empty() || (!v.all_ranks && world.rank() != 0)) continue;
    const std::string name = std::string(s.name) + "-" + (v.all_ranks ? std::string("dtp-sp-") + v.name : "plain");
    const std::string table =
        profile_step([&] { v.step(); }, profile_dir + "/" + name +
                                            (world.rank() > 0 ? "-rank" + std::to_string(world.rank()) : "") + ".json",
                     device_type == "cuda", 12);
    profiles += "\n### profile: " + name + " (one step, rank 0)\n\n" + table;
  }
  if (world.rank() != 0) return true;
  const Variant& plain_v = vs.back();
  const double b = median(plain_v.ms);
  bool ok = true;
  for (size_t i = 0; i + 1 < vs.size(); ++i) {
    std::vector<double> paired;
    for (size_t k = 0; k < vs[i].ms.size(); ++k) paired.push_back(vs[i].ms[k] / plain_v.ms[k]);
    const double a = median(vs[i].ms);
    std::printf("| %s | %s | %.2f | %.2f | %.3f | %.3f | %.2f | %lld |\n", s.name, vs[i].name, a, b, a / b,
                median(paired), a - b, static_cast<long long>(vs[i].dtensor_ops));
    if (std::abs(vs[i].first_loss - plain_v.first_loss) > 1e-4 * std::abs(plain_v.first_loss)) {
      std::fprintf(stderr, "dtp-bench: %s (SP %s): dtp's first loss %.7f differs from plain libtorch's %.7f\n",
                   s.name, vs[i].name, vs[i].first_loss, plain_v.first_loss);
      ok = false;
    }
  }
  return ok;
}

}  // namespace

bool run_device(const std::vector<const Size*>& sizes, const std::string& device_type, const std::vector<bool>& sps,
                int reps, int warmup, const ProcessGroup& world, const std::string& profile_dir) {
  if (world.rank() == 0) {
    std::printf("\n## dtp (TP=%d) vs plain libtorch on %s: training step (forward, loss, backward, AdamW) "
                "until the loss is on the host; median of %d reps, interleaved\n\n",
                world.size(), device_type.c_str(), reps);
    std::printf("| size | SP | dtp ms | plain ms | dtp / plain | dtp / plain, paired | dtp - plain ms | DTensor ops/step |\n");
    std::printf("|---|---|---|---|---|---|---|---|\n");
  }
  bool ok = true;
  std::string profiles;
  for (const Size* s : sizes) ok &= runSize(*s, device_type, sps, reps, warmup, world, profile_dir, profiles);
  if (!profiles.empty()) std::printf("%s", profiles.c_str());
  return ok;
}

}  // namespace dtp::bench
