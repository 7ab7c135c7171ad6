// clip_grad_norm_ on DTensor gradients equals libtorch's on one device
// (float64), for TP, FSDP and DDP, norms 2, 1 and infinity, with one
// all-reduce per process group in total.
#include "close.h"
#include "dist.h"
#include "llama_util.h"

#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/optim/clip_grad.h"

#include <torch/nn/utils/clip_grad.h>

#include <cmath>
#include <limits>
#include <set>

using namespace dtp;
using namespace dtp::models;
using dtp::test::kSeq;
using dtp::test::run_ranks;

namespace {

// The global batch of 4 sequences; dp ranks take their rows.
at::Tensor batchFor(int64_t vocab, int64_t dp_rank, int64_t dp) {
  at::Tensor b = at::cat({dtp::test::llama_batch(vocab, 0), dtp::test::llama_batch(vocab, 1)});
  return b.narrow(0, dp_rank * 4 / dp, 4 / dp);
}

void backwardOn(Llama& model, const at::Tensor& b) {
  llama_loss(model(b.narrow(1, 0, kSeq)), b.narrow(1, 1, kSeq)).backward();
}

struct Clipped {
  double norm;
  std::vector<at::Tensor> grads;  // full, in unique_parameters order
};

TEST(ClipGradNorm, EqualsOneDeviceWithOneAllReducePerGroup) {
  LlamaConfig c = dtp::test::small_llama_config(2);
  c.dtype = at::kDouble;
  const double kMax = 0.05;
  for (double p : {2.0, 1.0, std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE("norm " + std::to_string(p));
    Llama one(c);
    backwardOn(one, batchFor(c.vocab_size, 0, 1));
    Clipped want{torch::nn::utils::clip_grad_norm_(one->unique_parameters(), kMax, p), {}};
    want.grads = dtp::test::full_grads(one);
    ASSERT_GT(want.norm, kMax) << "the test must clip";
    for (const char* how : {"tp", "fsdp", "ddp"}) {
      SCOPED_TRACE(how);
      const bool tp_only = std::string(how) == "tp";
      run_ranks(tp_only ? 2 : 4, [&](int) {
        auto mesh = tp_only ? init_device_mesh("cpu", {2}, {"tp"}) : init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
        Llama model(c);
        apply_tensor_parallel(model, mesh, TensorParallelOptions{true, kSeq});
        if (std::string(how) == "fsdp") apply_fsdp(model, mesh);
        if (std::string(how) == "ddp") apply_ddp(model, mesh);
        const int64_t dp = tp_only ? 1 : 2, dp_rank = tp_only ? 0 : mesh.get_local_rank("dp");
        backwardOn(model, batchFor(c.vocab_size, dp_rank, dp));
        CommCounter comm;
        at::Tensor norm = clip_grad_norm_(model->unique_parameters(), kMax, p);
        // One per group the gradients are sharded or replicated over: tp, and
        // dp under FSDP (DDP's gradients live on the tp mesh, equal over dp).
        EXPECT_EQ(comm.count(CollectiveType::AllReduce), std::string(how) == "fsdp" ? 2 : 1) << comm.str();
        EXPECT_EQ(comm.total_count(), comm.count(CollectiveType::AllReduce));
        EXPECT_EQ(norm.dim(), 0);
        EXPECT_NEAR(norm.item<double>(), want.norm, 1e-12 * want.norm);
        const auto got = dtp::test::full_grads(model);
        ASSERT_EQ(got.size(), want.grads.size());
        for (size_t i = 0; i < got.size(); ++i) EXPECT_CLOSE(got[i], want.grads[i], 0.0, 1e-15) << i;
      });
    }
  }
}

// Under pipeline parallelism, (pp, tp) = (2, 2): each stage clips its own
// parameters with the norm over all of them (one more all-reduce, over pp).
TEST(ClipGradNorm, PipelineStagesShareTheWholeNorm) {
  LlamaConfig c = dtp::test::small_llama_config(2);
  c.dtype = at::kDouble;
  const double kMax = 0.05;
  for (double p : {2.0, std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE("norm " + std::to_string(p));
    Llama one(c);
    backwardOn(one, batchFor(c.vocab_size, 0, 1));
    const double want = torch::nn::utils::clip_grad_norm_(one->unique_parameters(), kMax, p);
    const auto want_grads = dtp::test::full_grads(one);
    run_ranks(4, [&](int) {
      auto mesh = init_device_mesh("cpu", {2, 2}, {"pp", "tp"});
      Llama full(c);
      const LlamaPipeline pipe = pipeline_llama(full, mesh, {"gpipe", 2});
      const at::Tensor b = batchFor(c.vocab_size, 0, 1);
      pipe.pipeline->step(b.narrow(1, 0, kSeq), b.narrow(1, 1, kSeq));
      CommCounter comm;
      at::Tensor norm = clip_grad_norm_(pipe.parameters(), kMax, p, mesh.get_group("pp"));
      EXPECT_EQ(comm.count(CollectiveType::AllReduce, mesh.get_group("pp").global_ranks()), 1) << comm.str();
      EXPECT_NEAR(norm.item<double>(), want, 1e-12 * want);
      std::set<const void*> mine;
      for (const auto& q : pipe.parameters()) mine.insert(q.unsafeGetTensorImpl());
      size_t i = 0;
      for (auto& q : full->unique_parameters()) {  // one device's order
        if (mine.count(q.unsafeGetTensorImpl())) {
          const at::Tensor g = is_dtensor(q) ? full_tensor(q.grad()) : q.grad();
          EXPECT_CLOSE(g, want_grads[i], 0.0, 1e-15) << i;
        }
        ++i;
      }
    });
  }
}

TEST(ClipGradNorm, PartialGradientAndBadNormTypeAreErrors) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"tp"});
    at::Tensor w = distribute_tensor(at::ones({4}), mesh, {Replicate()}).requires_grad_(true);
    w.mutable_grad() = from_local(at::ones({4}), mesh, {Partial()});
    dtp::test::expect_error([&] { clip_grad_norm_({w}, 1.0); }, {"clip_grad_norm_", "Partial", "redistribute"});
    dtp::test::expect_error([&] { clip_grad_norm_({w}, 1.0, -1.0); }, {"norm_type must be > 0"});
  });
}

}  // namespace
