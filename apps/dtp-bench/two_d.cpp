#include "two_d.h"

#include "memory.h"
#include "stats.h"

#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/models/parallelize.h"
#include "dtp/optim/adamw.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>

namespace dtp::bench {
namespace {

using namespace dtp::models;

struct Case {
  std::string name;
  std::function<double()> step;      // one training step; its loss
  std::function<void()> replay;      // its data-parallel collectives alone (none for TP alone)
  std::vector<at::Tensor> params;
  std::shared_ptr<torch::optim::Optimizer> opt;
  std::vector<double> ms, comm_ms;
  double first_loss = 0;
  int64_t dp_all_gather = 0, dp_reduce_scatter = 0, dp_all_reduce = 0, buckets = 0;
  ModelMemory memory;
};

// Elements of this rank's TP shards of `module`'s parameters (skipping the
// blocks for the root unit).
int64_t tpShardElements(torch::nn::Module& module, bool skip_layers) {
  int64_t n = 0;
  for (const auto& item : module.named_parameters()) {
    if (skip_layers && item.key().rfind("layers.", 0) == 0) continue;
    n += is_dtensor(item.value()) ? to_local(item.value().detach()).numel() : item.value().numel();
  }
  return n;
}

bool runSize(const Size& s, int64_t dp_degree, int reps, int warmup, const ProcessGroup& world) {
  const LlamaConfig c = s.config();
  const int64_t tp = world.size() / dp_degree;
  DeviceMesh mesh = init_device_mesh("cpu", {dp_degree, tp}, {"dp", "tp"});
  const ProcessGroup dp = mesh.get_group("dp");
  const auto dp_ranks = dp.global_ranks();
  TORCH_CHECK(s.batch % dp_degree == 0, "dtp-bench: batch ", s.batch, " of size ", s.name,
              " is not divisible by --dp ", dp_degree, ".");
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor batch =
      at::randint(c.vocab_size, {s.batch, s.seq + 1}, gen).narrow(0, dp.rank() * s.batch / dp_degree, s.batch / dp_degree);
  const at::Tensor tokens = batch.narrow(1, 0, s.seq), targets = batch.narrow(1, 1, s.seq);

  std::vector<Case> cases;
  auto add = [&](const std::string& how) {
    Llama m(c);
    apply_tensor_parallel(m, mesh, TensorParallelOptions{true, s.seq});
    Case& k = cases.emplace_back();
    k.name = how;
    if (how == "fsdp") {
      // The units' all-gathers and reduce-scatters in the order a step issues them.
      std::vector<int64_t> blocks;
      for (const auto& layer : *m->layers) blocks.push_back(tpShardElements(*layer, false));
      const int64_t root = tpShardElements(*m, true);
      k.replay = [dp, blocks, root, n = dp_degree] {
        auto ag = [&](int64_t e) {
          const auto sizes = chunk_sizes(e, n);
          dp.all_gather(at::zeros({sizes[dp.rank()]}), 0, sizes).wait();
        };
        auto rs = [&](int64_t e) { dp.reduce_scatter(at::zeros({e}), 0, chunk_sizes(e, n), ReduceOp::Avg).wait(); };
        ag(root);
        for (int64_t b : blocks) ag(b);
        for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
          ag(*it);
          rs(*it);
        }
        rs(root);
      };
      apply_fsdp(m, mesh);
    } else if (how == "ddp") {
      apply_ddp(m, mesh);
      std::vector<int64_t> buckets;
      auto named = m->named_parameters();
      for (const auto& fqns : replicate_buckets(*m)) {
        int64_t e = 0;
        for (const auto& f : fqns) e += is_dtensor(named[f]) ? to_local(named[f].detach()).numel() : named[f].numel();
        buckets.push_back(e);
      }
      k.buckets = static_cast<int64_t>(buckets.size());
      k.replay = [dp, buckets] {
        std::vector<Work> works;
        for (int64_t e : buckets) works.push_back(dp.all_reduce(at::zeros({e}), ReduceOp::Avg, /*async_op=*/true));
        for (auto& w : works) w.wait();
      };
    }
    k.params = m->unique_parameters();
    auto opt = std::make_shared<dtp::optim::AdamW>(k.params, torch::optim::AdamWOptions(1e-3));
    k.opt = opt;
    k.step = [m, opt, tokens, targets]() mutable {
      opt->zero_grad();
      at::Tensor l = llama_loss(m(tokens), targets);
      l.backward();
      opt->step();
      return l.item<double>();
    };
  };
  for (const char* how : {"tp only", "fsdp", "ddp"}) add(how);

  std::vector<size_t> order(cases.size());
  std::iota(order.begin(), order.end(), 0);
  std::mt19937 shuffler(11);  // the same orders on every rank
  for (int r = 0; r < warmup + reps; ++r) {
    std::shuffle(order.begin(), order.end(), shuffler);
    for (size_t i : order) {
      Case& k = cases[i];
      CommCounter counter;
      double loss = 0;
      const double ms = timed_max(world, [&] { loss = k.step(); });
      if (r == 0) k.first_loss = loss;
      if (r == warmup) {
        k.dp_all_gather = counter.count(CollectiveType::AllGather, dp_ranks);
        k.dp_reduce_scatter = counter.count(CollectiveType::ReduceScatter, dp_ranks);
        k.dp_all_reduce = counter.count(CollectiveType::AllReduce, dp_ranks);
      }
      if (r >= warmup) k.ms.push_back(ms);
      if (k.replay && r >= warmup) k.comm_ms.push_back(timed_max(world, k.replay));
    }
  }
  for (auto& k : cases) k.memory = state_memory(k.params, *k.opt);
  // One device's state: the whole model and its AdamW after one step.
  Llama single(c);
  dtp::optim::AdamW single_opt(single->unique_parameters(), torch::optim::AdamWOptions(1e-3));
  single_opt.zero_grad();
  llama_loss(single(tokens), targets).backward();
  single_opt.step();
  const ModelMemory one = state_memory(single->unique_parameters(), single_opt);
  auto stateBytes = [](const ModelMemory& m) {
    return static_cast<double>(m.params.total + m.grads.total + m.optimizer.total);
  };

  bool ok = true;
  const int64_t L = c.n_layers;
  for (const auto& k : cases) {
    if (std::abs(k.first_loss - cases[0].first_loss) > 1e-5) {
      std::fprintf(stderr, "dtp-bench: %s %s first loss %.6f differs from TP alone's %.6f\n", s.name, k.name.c_str(),
                   k.first_loss, cases[0].first_loss);
      ok = false;
    }
    const bool fsdp = k.name == "fsdp", ddp = k.name == "ddp";
    const int64_t want_ag = fsdp ? 2 * L + 1 : 0, want_rs = fsdp ? L + 1 : 0, want_ar = ddp ? k.buckets : 0;
    if (dp_degree > 1 && (k.dp_all_gather != want_ag || k.dp_reduce_scatter != want_rs || k.dp_all_reduce != want_ar)) {
      std::fprintf(stderr, "dtp-bench: %s %s: dp collectives %lld all-gather, %lld reduce-scatter, %lld all-reduce; "
                   "closed form %lld, %lld, %lld\n", s.name, k.name.c_str(), static_cast<long long>(k.dp_all_gather),
                   static_cast<long long>(k.dp_reduce_scatter), static_cast<long long>(k.dp_all_reduce),
                   static_cast<long long>(want_ag), static_cast<long long>(want_rs), static_cast<long long>(want_ar));
      ok = false;
    }
  }
  if (world.rank() == 0) {
    auto fmt = [](double x) {
      char b[32];
      std::snprintf(b, sizeof(b), "%.2f", x);
      return std::string(b);
    };
    const double compute = median(cases[0].ms);
    for (const auto& k : cases) {
      const double step = median(k.ms), comm = median(k.comm_ms);
      const double hidden = k.replay ? (compute + comm - step) / comm : 0.0;
      std::printf("| %s | %s | %.2f | %.2f | %s | %s | %lld / %lld / %lld | %.2f | %.4f |\n", s.name, k.name.c_str(),
                  step, compute, k.replay ? fmt(comm).c_str() : "-",
                  k.replay ? c10::str(static_cast<int>(100 * hidden), "%").c_str() : "-",
                  static_cast<long long>(k.dp_all_gather), static_cast<long long>(k.dp_reduce_scatter),
                  static_cast<long long>(k.dp_all_reduce), stateBytes(k.memory) / kMiB,
                  stateBytes(k.memory) / stateBytes(one));
    }
  }
  return ok;
}

}  // namespace

bool run_two_d(const std::vector<const Size*>& sizes, int64_t dp, int reps, int warmup, const ProcessGroup& world) {
  TORCH_CHECK(dp >= 1 && world.size() % dp == 0, "dtp-bench: --dp ", dp, " does not divide the ", world.size(),
              " ranks. Use a divisor of WORLD_SIZE.");
  const int64_t tp = world.size() / dp;
  if (world.rank() == 0) {
    std::printf("\n## 2-D: (dp, tp) = (%lld, %lld), sequence parallel; median of %d reps (ms)\n\n",
                static_cast<long long>(dp), static_cast<long long>(tp), reps);
    std::printf("step: the training step; TP alone: the same step without data parallelism (compute and TP "
                "communication); dp comm alone: the data-parallel collectives replayed by themselves; hidden: "
                "(TP alone + dp comm alone - step) / dp comm alone. State: parameters, gradients and AdamW per "
                "rank, and its ratio to one device's (ideal: 1/%lld for FSDP, 1/%lld otherwise).\n\n",
                static_cast<long long>(dp * tp), static_cast<long long>(tp));
    std::printf("| size | variant | step | TP alone | dp comm alone | hidden | dp all-gather / reduce-scatter / "
                "all-reduce per step | state MiB/rank | / one device |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|\n");
  }
  bool ok = true;
  for (const Size* s : sizes) ok &= runSize(*s, dp, reps, warmup, world);
  return ok;
}

}  // namespace dtp::bench
