// A training step under dtp reads no tensor value on the host. On a GPU each
// such read (item(), a bool of a comparison) stops the host until the GPU has
// caught up, and the kernels of the rest of the step are no longer queued
// ahead. Every read goes through aten::_local_scalar_dense, also on the CPU,
// so the count is checked here on any machine. The one read a CPU step has:
// loss_parallel's check that the targets lie in the vocabulary, which on a
// GPU is a device-side assert instead (no read).
#include "dist.h"
#include "host_reads.h"
#include "llama_util.h"

#include "dtp/dtensor.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/optim/adamw.h"
#include "dtp/optim/clip_grad.h"
#include "dtp/random.h"

using namespace dtp;
using namespace dtp::models;
using dtp::test::kSeq;
using dtp::test::HostReads;
using dtp::test::run_ranks;

namespace {

// Forward, loss, backward, clipping and an AdamW step.
void trainStep(Llama& model, dtp::optim::AdamW& opt, int64_t step, int64_t dp_rank, int64_t dp) {
  at::Tensor b = dtp::test::llama_batch(model->config.vocab_size, step);
  b = b.narrow(0, dp_rank * b.size(0) / dp, b.size(0) / dp);
  at::Tensor loss = llama_loss(model(b.narrow(1, 0, kSeq)), b.narrow(1, 1, kSeq));
  opt.zero_grad();
  loss.backward();
  clip_grad_norm_(model->unique_parameters(), 0.5);
  opt.step();
}

TEST(HostSync, CounterSeesAReadOnEveryThread) {  // so that a zero below means something
  HostReads reads;
  run_ranks(2, [](int) { (void)at::ones({2}).sum().item<double>(); });
  EXPECT_EQ(reads.count(), 2);
}

TEST(HostSync, TrainingStepsReadOnlyTheTargetCheck) {
  LlamaConfig c = dtp::test::small_llama_config(2);
  c.dropout = 0.1;
  for (const char* how : {"tp", "tp-no-sp", "fsdp+ac", "ddp"}) {
    SCOPED_TRACE(how);
    const std::string h = how;
    const bool two_d = h == "fsdp+ac" || h == "ddp";
    HostReads reads;
    int64_t before = -1, after = -1;
    run_ranks(two_d ? 4 : 2, [&](int rank) {
      auto mesh = two_d ? init_device_mesh("cpu", {2, 2}, {"dp", "tp"}) : init_device_mesh("cpu", {2}, {"tp"});
      dtp::manual_seed(3);
      Llama model(c);
      apply_tensor_parallel(model, mesh, TensorParallelOptions{h != "tp-no-sp", kSeq});
      if (h == "fsdp+ac") {
        apply_ac(model, ACOptions{ACMode::Selective, 1});
        apply_fsdp(model, mesh);
      }
      if (h == "ddp") apply_ddp(model, mesh);
      dtp::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-3));
      const int64_t dp = two_d ? 2 : 1, dp_rank = two_d ? mesh.get_local_rank("dp") : 0;
      trainStep(model, opt, 0, dp_rank, dp);  // first step: caches and first-use syncs fill
      ProcessGroup world = default_process_group();
      world.barrier();
      if (rank == 0) before = reads.count();
      world.barrier();
      trainStep(model, opt, 1, dp_rank, dp);
      trainStep(model, opt, 2, dp_rank, dp);
      world.barrier();
      if (rank == 0) after = reads.count();
    });
    const int64_t ranks = two_d ? 4 : 2, target_checks = 2 * ranks;
    EXPECT_EQ(after - before, target_checks) << "host reads in two " << how << " training steps on all ranks";
  }
}

}  // namespace
