// dtp on CUDA tensors (ctest label `cuda`): DTensor ops, random ops, the TP
// Llama with loss_parallel and checkpoints, against plain libtorch on the same
// GPU. One GPU gives meshes of one rank (NCCL refuses two ranks on one GPU);
// with more, the tests also run TP over two GPUs. Without a GPU every test is
// skipped, and says so.
#include "dist.h"
#include "files.h"
#include "host_reads.h"
#include "llama_util.h"

#include "dtp/dtensor.h"
#include "dtp/models/checkpoint.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/optim/adamw.h"
#include "dtp/random.h"

#include <ATen/Context.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>


using namespace dtp;
using namespace dtp::models;
using dtp::test::kSeq;

namespace {

int gpus() { return at::hasCUDA() ? static_cast<int>(c10::impl::getDeviceGuardImpl(c10::kCUDA)->deviceCount()) : 0; }

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (gpus() == 0) GTEST_SKIP() << "no CUDA device (or a CPU-only libtorch): CUDA test skipped";
  }
  // TP degrees to test: 1, and 2 where there are two GPUs.
  static std::vector<int> degrees() { return gpus() >= 2 ? std::vector<int>{1, 2} : std::vector<int>{1}; }
  static void onRanks(int n, const std::function<void(int)>& body) { dtp::test::run_ranks(n, body, std::chrono::seconds(120), "auto"); }
};

double maxDiff(const at::Tensor& a, const at::Tensor& b) { return (a.cpu() - b.cpu()).abs().max().item<double>(); }

TEST_F(CudaTest, MeshDeviceAndDistributeTensor) {
  onRanks(1, [](int) {
    auto mesh = init_device_mesh("cuda", {1}, {"tp"});
    EXPECT_TRUE(mesh.device().is_cuda());
    const at::Tensor x = at::randn({5, 3}, at::kDouble);  // on the CPU: moves to the mesh's GPU
    at::Tensor d = distribute_tensor(x, mesh, {Shard(0)});
    EXPECT_TRUE(to_local(d).is_cuda());
    const at::Tensor w = at::randn({3, 4}, at::kDouble).cuda();
    at::Tensor y = at::matmul(d, distribute_tensor(w, mesh, {Replicate()})).softmax(-1).sum(0);
    EXPECT_TRUE(full_tensor(y).is_cuda());
    EXPECT_EQ(maxDiff(full_tensor(y), at::matmul(x.cuda(), w).softmax(-1).sum(0)), 0.0);
  });
}

// Dropout and rand_like on DTensors on GPUs equal one GPU's from the same
// seed, for any placement.
TEST_F(CudaTest, RandomOpsEqualOneGpu) {
  const at::Tensor x = at::randn({8, 6}, at::kFloat);
  const at::Device gpu0(at::kCUDA, 0);
  at::Generator gpu0_default = at::globalContext().defaultGenerator(gpu0);
  gpu0_default.set_current_seed(11);
  const at::Tensor want_mask = std::get<1>(at::native_dropout(x.to(gpu0), 0.3, true)).cpu();
  const at::Tensor want_u = at::rand_like(x.to(gpu0)).cpu();
  for (int tp : degrees()) {
    onRanks(tp, [&](int) {
      auto mesh = init_device_mesh("cuda", {tp}, {"tp"});
      for (const Placements& p : {Placements{Shard(0)}, Placements{Shard(1)}, Placements{Replicate()}}) {
        dtp::manual_seed(11);
        at::Tensor mask = std::get<1>(at::native_dropout(distribute_tensor(x, mesh, p), 0.3, true));
        at::Tensor u = at::rand_like(distribute_tensor(x, mesh, p));
        EXPECT_TRUE(at::equal(full_tensor(mask).cpu(), want_mask)) << tp << " ranks";
        EXPECT_EQ(maxDiff(full_tensor(u), want_u), 0.0) << tp << " ranks";
      }
    });
  }
}

// The same for a non-contiguous input (a transposed view of a DTensor): the
// mask is drawn for the view's shape, as on one GPU.
TEST_F(CudaTest, DropoutOfNonContiguousInputsEqualsOneGpu) {
  const at::Tensor x = at::randn({8, 6}, at::kFloat);
  const at::Device gpu0(at::kCUDA, 0);
  at::Generator gpu0_default = at::globalContext().defaultGenerator(gpu0);
  gpu0_default.set_current_seed(5);
  const at::Tensor want_mask = std::get<1>(at::native_dropout(x.to(gpu0).t(), 0.3, true)).cpu();
  for (int tp : degrees()) {
    onRanks(tp, [&](int) {
      auto mesh = init_device_mesh("cuda", {tp}, {"tp"});
      for (const Placements& p : {Placements{Shard(0)}, Placements{Shard(1)}, Placements{Replicate()}}) {
        dtp::manual_seed(5);
        const at::Tensor view = distribute_tensor(x, mesh, p).t();
        ASSERT_FALSE(to_local(view).is_contiguous() && to_local(view).size(0) > 1 && to_local(view).size(1) > 1);
        at::Tensor mask = std::get<1>(at::native_dropout(view, 0.3, true));
        EXPECT_TRUE(at::equal(full_tensor(mask).cpu(), want_mask)) << tp << " ranks, " << p[0].str();
      }
    });
  }
}

// Three AdamW steps of the TP Llama (loss_parallel) in float64 on the GPU
// equal plain libtorch's on the GPU, up to float64 rounding amplified by
// AdamW (NOTE: [Float64 parity tolerance] in tests/llama_test.cpp).
TEST_F(CudaTest, LlamaTrainsLikeOneGpuInFloat64) {
  for (int tp : degrees()) {
    LlamaConfig c = dtp::test::small_llama_config(tp);
    c.dtype = at::kDouble;
    c.device = at::Device(at::kCUDA, 0);
    Llama one(c);
    torch::optim::AdamW one_opt(one->parameters(), torch::optim::AdamWOptions(1e-2));
    const auto want = dtp::test::train_llama(one, one_opt, 0, 3);
    std::vector<at::Tensor> want_params;
    for (auto& p : one->unique_parameters()) want_params.push_back(p.detach().cpu());
    onRanks(tp, [&](int) {
      auto mesh = init_device_mesh("cuda", {tp}, {"tp"});
      LlamaConfig mine = c;
      mine.device = mesh.device();
      mine.deferred_init = true;
      Llama model(mine);
      apply_tensor_parallel(model, mesh, TensorParallelOptions{true, kSeq});
      init_weights(model);
      dtp::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
      const auto got = dtp::test::train_llama(model, opt, 0, 3);
      for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-10) << "step " << i;
      const auto params = model->unique_parameters();
      for (size_t i = 0; i < params.size(); ++i)
        EXPECT_LE(maxDiff(is_dtensor(params[i]) ? full_tensor(params[i].detach()) : params[i].detach(), want_params[i]), 3e-10);
    });
  }
}

// On a GPU a step of the TP Llama reads nothing on the host (see
// tests/host_sync_test.cpp for the CPU).
TEST_F(CudaTest, TrainingStepReadsNothingOnTheHost) {
  onRanks(1, [](int) {
    auto mesh = init_device_mesh("cuda", {1}, {"tp"});
    LlamaConfig c = dtp::test::small_llama_config(1);
    c.device = mesh.device();
    Llama model(c);
    apply_tensor_parallel(model, mesh, TensorParallelOptions{true, kSeq});
    dtp::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-3));
    auto step = [&](int64_t s) {
      at::Tensor b = dtp::test::llama_batch(c.vocab_size, s).to(mesh.device());
      at::Tensor loss = llama_loss(model(b.narrow(1, 0, kSeq)), b.narrow(1, 1, kSeq));
      opt.zero_grad();
      loss.backward();
      opt.step();
    };
    step(0);
    dtp::test::HostReads reads;
    step(1);
    EXPECT_EQ(reads.count(), 0);
  });
}

class CudaCheckpointTest : public dtp::test::TempDirTest {
 protected:
  void SetUp() override {
    if (gpus() == 0) GTEST_SKIP() << "no CUDA device (or a CPU-only libtorch): CUDA test skipped";
    TempDirTest::SetUp();
  }
};

// A checkpoint written from GPU shards loads into a CPU model, bit for bit.
TEST_F(CudaCheckpointTest, SavedOnTheGpuLoadsOnTheCpu) {
  const std::string path = file("ckpt.safetensors");
  LlamaConfig c = dtp::test::small_llama_config(1);
  std::vector<at::Tensor> saved;
  dtp::test::run_ranks(1, [&](int) {
    auto mesh = init_device_mesh("cuda", {1}, {"tp"});
    LlamaConfig mine = c;
    mine.device = mesh.device();
    Llama model(mine);
    apply_tensor_parallel(model, mesh, TensorParallelOptions{true, kSeq});
    dtp::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-3));
    dtp::test::train_llama(model, opt, 0, 2);
    save_checkpoint(path, model, opt, 2);
    for (auto& p : model->unique_parameters()) saved.push_back(full_tensor(p.detach()).cpu());
  }, std::chrono::seconds(120), "auto");
  Llama cpu(c);
  torch::optim::AdamW opt(cpu->parameters(), torch::optim::AdamWOptions(1e-3));
  EXPECT_EQ(load_checkpoint(path, cpu, &opt), 2);
  const auto params = cpu->unique_parameters();
  ASSERT_EQ(params.size(), saved.size());
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i], saved[i])) << i;
}

}  // namespace
