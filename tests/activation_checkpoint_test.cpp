// Activation checkpointing: the reference Llama under TP with apply_ac
// (full, every other block, selective) trains exactly as without it and as
// one device (float64, dropout included); full mode repeats exactly the
// forward's collectives of the checkpointed blocks, selective mode none;
// composition with fully_shard and replicate; the save list; the errors.
#include "close.h"
#include "dist.h"
#include "llama_util.h"

#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/optim/adamw.h"
#include "dtp/ac/activation_checkpoint.h"
#include "dtp/random.h"
#include "dtensor/sharding_prop.h"

#include <torch/nn/modules/linear.h>

#include <functional>
#include <map>
#include <optional>

using namespace dtp;
using namespace dtp::models;
using dtp::test::kSeq;
using dtp::test::run_ranks;

namespace {

constexpr int kSteps = 3;

using dtp::test::Trace;

Trace train(Llama& model) { return dtp::test::train_trace(model, kSteps); }

// As NOTE: [Float64 parity tolerance] in llama_test.cpp: 1e-12 on losses,
// steps * 1e-11 on weights. Against the same parallel run without AC the
// recomputation repeats the same ops in the same order: equal up to the
// order parameter gradients are summed in (a few float64 ulps).
void expectSame(const Trace& got, const Trace& want) { dtp::test::expect_same_trace(got, want, 1e-12, kSteps * 1e-11); }

struct Variant {
  const char* name;
  ACMode mode;
  int64_t every;
  std::vector<std::string> save_ops = default_sac_save_ops();
};
const Variant kVariants[] = {{"full", ACMode::Full, 1}, {"full, every other block", ACMode::Full, 2},
                             {"selective", ACMode::Selective, 1},
                             {"selective, an empty save list", ACMode::Selective, 1, {}}};

class ActivationCheckpointTest : public ::testing::TestWithParam<int> {};

// 3 AdamW steps with dropout: AC on equals AC off and one device.
TEST_P(ActivationCheckpointTest, TrainsLikeOneDeviceInFloat64) {
  const int w = GetParam();
  LlamaConfig c = dtp::test::small_llama_config(w);
  c.dtype = at::kDouble;
  c.dropout = 0.1;
  Llama one(c);
  at::manual_seed(123);
  const Trace want = train(one);
  for (const Variant& v : kVariants) {
    for (bool sp : {true, false}) {
      SCOPED_TRACE(std::string(v.name) + (sp ? ", sp" : ", no sp"));
      run_ranks(w, [&](int) {
        auto mesh = init_device_mesh("cpu", {w}, {"tp"});
        Llama model(c);
        apply_tensor_parallel(model, mesh, TensorParallelOptions{sp, kSeq});
        apply_ac(model, ACOptions{v.mode, v.every, v.save_ops});
        dtp::manual_seed(123);
        expectSame(train(model), want);
      });
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ActivationCheckpointTest, ::testing::Values(2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

// Collectives of one step: full mode adds exactly the checkpointed blocks'
// forward collectives (counted per module in a forward without AC);
// selective mode adds none: its recomputation replays the first pass's.
TEST(ActivationCheckpointCollectives, FullRepeatsTheForwardsSelectiveNone) {
  LlamaConfig c = dtp::test::small_llama_config(2);
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"tp"});
    at::Tensor batch = dtp::test::llama_batch(c.vocab_size, 0);
    auto step = [&](Llama& model) {
      CommCounter comm;
      llama_loss(model(batch.narrow(1, 0, kSeq)), batch.narrow(1, 1, kSeq)).backward();
      return std::array<int64_t, 3>{comm.count(CollectiveType::AllReduce), comm.count(CollectiveType::AllGather),
                                    comm.count(CollectiveType::ReduceScatter)};
    };
    Llama plain(c);
    apply_tensor_parallel(plain, mesh, TensorParallelOptions{true, kSeq});
    const auto off = step(plain);
    int64_t block_forward = 0;  // collectives inside the blocks in one forward
    {
      CommCounter comm;
      at::NoGradGuard no_grad;
      plain(batch.narrow(1, 0, kSeq));
      for (const auto& [module, counts] : comm.per_module())
        if (module.rfind("layers.", 0) == 0)
          for (const auto& [type, n] : counts) block_forward += n;
    }
    EXPECT_EQ(block_forward, 2 * 2 * c.n_layers) << "SP: an all-gather and a reduce-scatter per attention and MLP";
    auto dtensorOps = [] {
      const dtp::PropagationCacheStats st = dtp::propagation_cache_stats();
      return st.hits + st.misses;  // one per op through the DTensor dispatcher
    };
    std::map<std::string, int64_t> dtensor_ops;
    for (const Variant& v : kVariants) {
      SCOPED_TRACE(v.name);
      Llama model(c);
      apply_tensor_parallel(model, mesh, TensorParallelOptions{true, kSeq});
      apply_ac(model, ACOptions{v.mode, v.every, v.save_ops});
      const int64_t ops_before = dtensorOps();
      const auto on = step(model);
      dtensor_ops[v.name] = dtensorOps() - ops_before;
      const int64_t blocks = (c.n_layers + v.every - 1) / v.every;
      const int64_t extra = v.mode == ACMode::Full ? block_forward * blocks / c.n_layers : 0;
      EXPECT_EQ(on[0], off[0]);
      EXPECT_EQ(on[1] + on[2], off[1] + off[2] + extra);
    }
    // The save list is what selective mode keeps: without the matrix
    // products, the recomputation runs each block's 7 projections again.
    EXPECT_EQ(dtensor_ops["selective, an empty save list"] - dtensor_ops["selective"], 7 * c.n_layers);
  });
}

// Two AdamW steps of `model` (seeded dropout) on `batch`: the losses, the
// full parameters and `count` of the last step's collectives.
struct TwoSteps {
  std::vector<double> losses;
  std::vector<std::pair<std::string, at::Tensor>> params;
  std::vector<int64_t> counts;
};

TwoSteps twoSteps(Llama model, const at::Tensor& batch, const std::function<std::vector<int64_t>(const CommCounter&)>& count) {
  dtp::manual_seed(5);
  dtp::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
  TwoSteps out;
  for (int step = 0; step < 2; ++step) {
    CommCounter comm;
    at::Tensor loss = llama_loss(model(batch.narrow(1, 0, kSeq)), batch.narrow(1, 1, kSeq));
    opt.zero_grad();
    loss.backward();
    opt.step();
    out.counts = count(comm);
    out.losses.push_back(full_tensor(loss).item<double>());
  }
  out.params = dtp::test::full_named_params(model);
  return out;
}

// Equal to the same run without AC (the recomputation repeats the same ops).
void expectSameAsWithoutAc(const TwoSteps& on, const TwoSteps& off) {
  for (size_t i = 0; i < off.losses.size(); ++i) EXPECT_NEAR(on.losses[i], off.losses[i], 1e-12);
  for (size_t i = 0; i < off.params.size(); ++i)
    EXPECT_CLOSE(on.params[i].second, off.params[i].second, 0.0, 2e-11) << off.params[i].first;
}

// Data parallelism after AC, as torchtitan orders them, on (dp, tp) = (2, 2)
// with full and selective AC: trains as without AC.
// - fully_shard: per block the recomputation's all-gather replaces
//   backward's, so dp collectives per step are unchanged.
// - replicate (DDP), with one bucket for the whole model and with one per
//   parameter: a bucket's node runs once in each backward that reaches it,
//   the outer one (embedding, final norm, head) and each checkpointed
//   block's nested recomputation, so one whole-model bucket is all-reduced
//   1 + n_layers times per step, and per-parameter buckets once each, as
//   without AC.
TEST(ActivationCheckpointDataParallel, TrainsAsWithoutAcWithClosedFormDpCollectives) {
  LlamaConfig c = dtp::test::small_llama_config(2);
  c.dtype = at::kDouble;
  c.dropout = 0.1;
  run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    const auto dp_ranks = mesh.get_group("dp").global_ranks();
    const at::Tensor batch = dtp::test::llama_batch(c.vocab_size, 0).narrow(0, mesh.get_local_rank("dp"), 1);
    auto dpCounts = [&](const CommCounter& comm) {
      return std::vector<int64_t>{comm.count(CollectiveType::AllGather, dp_ranks),
                                  comm.count(CollectiveType::ReduceScatter, dp_ranks),
                                  comm.count(CollectiveType::AllReduce, dp_ranks)};
    };
    for (const char* how : {"fsdp", "ddp", "ddp-per-param"}) {
      SCOPED_TRACE(how);
      const bool fsdp = std::string(how) == "fsdp";
      auto build = [&](std::optional<ACMode> mode) {
        Llama model(c);
        apply_tensor_parallel(model, mesh, TensorParallelOptions{true, kSeq});
        if (mode) apply_ac(model, ACOptions{*mode, 1});
        if (fsdp) apply_fsdp(model, mesh);
        else apply_ddp(model, mesh, ReplicateOptions{std::string(how) == "ddp" ? 25.0 : 1e-9});
        return model;
      };
      Llama plain = build(std::nullopt);
      const int64_t buckets = fsdp ? 0 : static_cast<int64_t>(replicate_buckets(*plain).size());
      const TwoSteps off = twoSteps(plain, batch, dpCounts);
      const std::vector<int64_t> want_off = fsdp ? std::vector<int64_t>{2 * c.n_layers + 1, c.n_layers + 1, 0}
                                                 : std::vector<int64_t>{0, 0, buckets};
      EXPECT_EQ(off.counts, want_off);
      for (ACMode mode : {ACMode::Full, ACMode::Selective}) {
        const TwoSteps on = twoSteps(build(mode), batch, dpCounts);
        expectSameAsWithoutAc(on, off);
        std::vector<int64_t> want = want_off;
        if (!fsdp && buckets == 1) want[2] = 1 + c.n_layers;
        EXPECT_EQ(on.counts, want);
      }
    }
  });
}

TEST(ActivationCheckpointErrors, NameTheThingAndTheFix) {
  using dtp::test::expect_error;
  LlamaConfig c = dtp::test::small_llama_config(2);
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 1}, {"dp", "tp"});
    Llama model(c);
    apply_ac(model);
    expect_error([&] { apply_ac(model); }, {"apply_ac: layers.0: checkpoint_wrapper:", "already checkpointed"});
    expect_error([&] { apply_ac(model, ACOptions{ACMode::Full, 0}); }, {"every=0"});
    torch::nn::Linear plain(2, 2);
    expect_error([&] { checkpoint_wrapper(*plain); }, {"does not run hooks", "DTP_MODULE"});
    // An input changed in place after the checkpointed call.
    at::Tensor x = at::randn({3}, at::kDouble).requires_grad_(true);
    at::Tensor y = x * 1.0;
    at::Tensor z = checkpoint([](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{in[0].sin()}; }, {y})[0];
    {
      at::NoGradGuard no_grad;
      y.add_(1.0);
    }
    expect_error([&] { z.sum().backward(); }, {"input 0 was changed in place", "clone()"});
  });
}

}  // namespace
