// HSDP across hosts (multihost.sh hsdp), run under dtprun on 2 hosts x 2
// ranks: fully_shard on (dp_replicate, dp_shard) = (2, 2), global rank =
// 2 x replica + shard, so each host holds one replica (dp_shard within it,
// through its shared memory) and dp_replicate spans the hosts (Gloo). The
// small float64 Llama of tests/llama_util.h, 6 AdamW steps on each rank's
// slice of a 4-sequence batch, against one device on rank 0 training the
// whole batch (NOTE: [Data-parallel parity tolerance] in
// tests/data_parallel_test.cpp: 1e-11 per step on the weights, 10x that on
// the losses). The second step's collectives against the closed form of
// FullyShardHsdp: over dp_shard 2L+1 all-gathers and L+1 reduce-scatters,
// over dp_replicate L+1 all-reduces, nothing else. Prints "parity ... ok" and
// "done: ... collectives (...)" as dtp-train does; exits 1 on a mismatch.
#include "../llama_util.h"

#include "dtp/comm_counter.h"
#include "dtp/device_mesh.h"
#include "dtp/models/parallelize.h"
#include "dtp/optim/adamw.h"
#include "dtp/process_group.h"
#include "dtp/random.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>

using namespace dtp;
using namespace dtp::models;
using dtp::test::kSeq;

namespace {

constexpr int kSteps = 6;

// 4 sequences per step, sliced over the 4 dp ranks (or all on one device).
at::Tensor globalBatch(int64_t vocab, int step) {
  return at::cat({dtp::test::llama_batch(vocab, 2 * step), dtp::test::llama_batch(vocab, 2 * step + 1)});
}

// One device, the whole batch of each step.
std::vector<double> trainAlone(Llama& model) {
  dtp::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
  std::vector<double> losses;
  for (int step = 0; step < kSteps; ++step) {
    at::Tensor batch = globalBatch(model->config.vocab_size, step);
    at::Tensor loss = llama_loss(model(batch.narrow(1, 0, kSeq)), batch.narrow(1, 1, kSeq));
    opt.zero_grad();
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

}  // namespace

int main() {
  ProcessGroup world = init_process_group();
  TORCH_CHECK(world.size() == 4, "hsdp_train: expected 4 ranks, got ", world.size());
  LlamaConfig c = dtp::test::small_llama_config(1);
  c.dtype = at::kDouble;
  auto mesh = init_device_mesh("cpu", {2, 2}, {"dp_replicate", "dp_shard"});
  Llama model(c);
  apply_fsdp(model, mesh);
  const ProcessGroup dp = data_parallel_group(mesh);
  const auto shard = mesh.get_group("dp_shard").global_ranks(), rep = mesh.get_group("dp_replicate").global_ranks();
  dtp::manual_seed(123);
  at::manual_seed(123);

  // Counted over the whole run; the closed form checked on step 2 (the first also syncs the generators).
  CommCounter all;
  std::vector<double> losses;
  CommCounter step2;
  {
    dtp::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < kSteps; ++step) {
      at::Tensor batch = globalBatch(c.vocab_size, step).narrow(0, dp.rank(), 1);
      if (step == 1) step2.reset();
      at::Tensor loss = llama_loss(model(batch.narrow(1, 0, kSeq)), batch.narrow(1, 1, kSeq));
      opt.zero_grad();
      loss.backward();
      if (step == 1) {
        const int64_t L = c.n_layers;
        const bool ok = step2.count(CollectiveType::AllGather, shard) == 2 * L + 1 &&
                        step2.count(CollectiveType::ReduceScatter, shard) == L + 1 &&
                        step2.count(CollectiveType::AllReduce, rep) == L + 1 && step2.total_count() == 4 * L + 3;
        if (world.rank() == 0)
          std::printf("step 2 forward+backward: %s (closed form: %lld all-gathers and %lld reduce-scatters over dp_shard "
                      "%s, %lld all-reduces over dp_replicate %s): %s\n",
                      step2.str().c_str(), static_cast<long long>(2 * L + 1), static_cast<long long>(L + 1),
                      c10::str(c10::ArrayRef<int>(shard)).c_str(), static_cast<long long>(L + 1),
                      c10::str(c10::ArrayRef<int>(rep)).c_str(), ok ? "ok" : "FAILED");
        if (!ok) return 1;
      }
      opt.step();
      at::Tensor l = (is_dtensor(loss) ? full_tensor(loss) : loss).detach().clone();
      losses.push_back(dp.all_reduce(l, ReduceOp::Avg).wait().item<double>());
    }
  }
  const auto params = dtp::test::full_named_params(model);
  if (world.rank() != 0) {
    std::printf("done: %d steps, 0 tok/s, %lld collectives (%s)\n", kSteps, static_cast<long long>(all.total_count()),
                all.str().c_str());
    return 0;
  }
  const int64_t counted = all.total_count();
  const std::string counts = all.str();
  Llama one(c);
  at::manual_seed(123);
  const std::vector<double> want = trainAlone(one);
  const auto want_params = dtp::test::full_named_params(one);
  double loss_diff = 0, param_diff = 0;
  for (int i = 0; i < kSteps; ++i) loss_diff = std::max(loss_diff, std::abs(losses[i] - want[i]));
  for (size_t i = 0; i < params.size(); ++i)
    param_diff = std::max(param_diff, (params[i].second - want_params[i].second).abs().max().item<double>());
  const double param_tol = kSteps * 1e-11, loss_tol = 10 * param_tol;
  const bool ok = loss_diff <= loss_tol && param_diff <= param_tol && params.size() == want_params.size();
  std::printf("parity vs one device in float64 over %d steps: max |loss diff| %.3g, max |param diff| %.3g "
              "(tolerance %.3g, %.3g): %s\n",
              kSteps, loss_diff, param_diff, loss_tol, param_tol, ok ? "ok" : "FAILED");
  std::printf("done: %d steps, 0 tok/s, %lld collectives (%s)\n", kSteps, static_cast<long long>(counted), counts.c_str());
  return ok ? 0 : 1;
}
