// 2-D parallelism: the reference Llama with TP on "tp" and fully_shard on
// "dp" of a (dp, tp) mesh, against the same model on one device training the
// whole batch; collectives per step against their closed form; the errors.
#include "dist.h"
#include "llama_util.h"

#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/models/llama.h"
#include "dtp/optim/adamw.h"
#include "dtp/parallel/parallelize.h"
#include "dtp/random.h"

using namespace dtp;
using namespace dtp::models;
using dtp::test::kSeq;
using dtp::test::run_ranks;

namespace {

constexpr int kSteps = 20;

struct Trace {
  std::vector<double> losses;
  std::vector<std::pair<std::string, at::Tensor>> params;  // full
};

// 4 sequences per step, so that dp = 1, 2 and 4 split it evenly.
at::Tensor globalBatch(int64_t vocab, int step) {
  return at::cat({dtp::test::llama_batch(vocab, 2 * step), dtp::test::llama_batch(vocab, 2 * step + 1)});
}

// Trains kSteps on this dp rank's rows of each global batch; the loss
// reported is the average over dp (equal token counts per rank).
Trace train(Llama& model, const ProcessGroup* dp) {
  dtp::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
  Trace t;
  for (int step = 0; step < kSteps; ++step) {
    at::Tensor batch = globalBatch(model->config.vocab_size, step);
    if (dp) batch = batch.narrow(0, dp->rank() * batch.size(0) / dp->size(), batch.size(0) / dp->size());
    at::Tensor loss = llama_loss(model(batch.narrow(1, 0, kSeq)), batch.narrow(1, 1, kSeq));
    opt.zero_grad();
    loss.backward();
    opt.step();
    at::Tensor l = (is_dtensor(loss) ? full_tensor(loss) : loss).detach().clone();
    t.losses.push_back((dp ? dp->all_reduce(l, ReduceOp::Avg).wait() : l).item<double>());
  }
  t.params = dtp::test::full_named_params(model);
  return t;
}

// NOTE: [Data-parallel parity tolerance] As NOTE: [Float64 parity
// tolerance]: data parallelism adds one more change of summation order (the
// average over dp of per-rank mean losses' gradients), so gradients differ
// from one device's by ~1e-17 and AdamW moves a weight by at most
// lr * 1e-17 / eps = 1e-11 per step: 2e-10 after 20 steps. A loss sees the
// weights' change times its gradient's L1 norm (< 10 here): 2e-9.
void expectSame(const Trace& got, const Trace& want) {
  constexpr double param_tol = kSteps * 1e-11, loss_tol = 10 * param_tol;
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < got.losses.size(); ++i) EXPECT_NEAR(got.losses[i], want.losses[i], loss_tol) << "step " << i;
  ASSERT_EQ(got.params.size(), want.params.size());
  for (size_t i = 0; i < got.params.size(); ++i) {
    EXPECT_EQ(got.params[i].first, want.params[i].first);
    const double diff = (got.params[i].second - want.params[i].second).abs().max().item<double>();
    EXPECT_LE(diff, param_tol) << got.params[i].first;
  }
}

struct Layout {
  int64_t dp, tp;
  bool sp;
};

class DataParallelTest : public ::testing::TestWithParam<Layout> {};

// 20 AdamW steps equal one device in float64, for (dp, tp) = (2, 2) with and
// without SP, (4, 1) and (1, 4); tied embeddings on (2, 2). fully_shard and
// replicate (with one bucket per parameter, and with the default buckets).
TEST_P(DataParallelTest, TrainsLikeOneDeviceInFloat64) {
  const Layout l = GetParam();
  for (const char* how : {"fsdp", "ddp", "ddp-per-param"})
  for (bool tied : {false, true}) {
    SCOPED_TRACE(how);
    if (tied && l.dp != 2) continue;
    SCOPED_TRACE(tied ? "tied" : "untied");
    LlamaConfig c = dtp::test::small_llama_config(static_cast<int>(l.tp));
    c.dtype = at::kDouble;
    c.tie_embeddings = tied;
    Llama one(c);
    const Trace want = train(one, nullptr);
    run_ranks(static_cast<int>(l.dp * l.tp), [&](int) {
      auto mesh = init_device_mesh("cpu", {l.dp, l.tp}, {"dp", "tp"});
      Llama model(c);
      apply_tensor_parallel(model, mesh, TensorParallelOptions{l.sp, kSeq});
      if (std::string(how) == "fsdp") {
        apply_fsdp(model, mesh);
        for (auto& [name, p] : model->unique_named_parameters()) {
          const auto& spec = dtensor_spec(p);
          ASSERT_EQ(spec.placements.size(), 2u) << name;
          EXPECT_EQ(spec.placements[1], Shard(0)) << name << " " << spec.str();
        }
      } else {
        apply_ddp(model, mesh, ReplicateOptions{std::string(how) == "ddp" ? 25.0 : 1e-9});
        EXPECT_EQ(replicate_buckets(*model).size(), std::string(how) == "ddp" ? 1u : model->unique_parameters().size());
      }
      const ProcessGroup dp = mesh.get_group("dp");
      expectSame(train(model, &dp), want);
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, DataParallelTest,
                         ::testing::Values(Layout{2, 2, true}, Layout{2, 2, false}, Layout{4, 1, true},
                                           Layout{1, 4, true}),
                         [](const auto& info) {
                           return "dp" + std::to_string(info.param.dp) + "tp" + std::to_string(info.param.tp) +
                                  (info.param.sp ? "sp" : "nosp");
                         });

// Bytes of this rank's TP shards of the parameters of `module`, skipping
// the transformer blocks when `root` (what each fully_shard unit gathers).
int64_t tpShardBytes(torch::nn::Module& module, bool root) {
  int64_t n = 0;
  for (const auto& item : module.named_parameters()) {
    if (root && item.key().rfind("layers.", 0) == 0) continue;
    if (root && item.key() == "output.weight" && item.value().is_same(module.named_parameters()["tok_embeddings.weight"]))
      continue;
    n += to_local(item.value()).numel() * item.value().element_size();
  }
  return n;
}

// Per step on dp: each block one all-gather in forward and one in backward,
// the root one in forward; one reduce-scatter per unit; bytes: the units'
// TP shards. On tp: what TP alone issues, except that the Partial
// gradients of norm weights (SP) are summed once per unit on the dp shard
// (NOTE: [Partial gradients under fully_shard]) instead of once per step.
// Gathered parameters are freed after forward (blocks) and after backward.
TEST(FullyShardCollectives, PerStepMatchTheClosedForm) {
  for (bool sp : {true, false}) {
    SCOPED_TRACE(sp ? "sp" : "no sp");
    LlamaConfig c = dtp::test::small_llama_config(2);
    run_ranks(4, [&](int) {
      auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
      const auto dp_ranks = mesh.get_group("dp").global_ranks(), tp_ranks = mesh.get_group("tp").global_ranks();
      at::Tensor batch = dtp::test::llama_batch(c.vocab_size, 0).narrow(0, mesh.get_local_rank("dp"), 1);
      auto step = [&](Llama& model) {
        CommCounter comm;
        llama_loss(model(batch.narrow(1, 0, kSeq)), batch.narrow(1, 1, kSeq)).backward();
        return std::array<int64_t, 3>{comm.count(CollectiveType::AllReduce, tp_ranks),
                                      comm.count(CollectiveType::AllGather, tp_ranks),
                                      comm.count(CollectiveType::ReduceScatter, tp_ranks)};
      };
      Llama tp_only(c);
      apply_tensor_parallel(tp_only, mesh, TensorParallelOptions{sp, kSeq});
      const auto want_tp = step(tp_only);
      int64_t block_bytes = 0;
      for (const auto& layer : *tp_only->layers) block_bytes += tpShardBytes(*layer, false);
      const int64_t root_bytes = tpShardBytes(*tp_only, true);

      Llama model(c);
      apply_tensor_parallel(model, mesh, TensorParallelOptions{sp, kSeq});
      apply_fsdp(model, mesh);
      const int64_t L = c.n_layers;
      CommCounter comm;
      at::Tensor loss = llama_loss(model(batch.narrow(1, 0, kSeq)), batch.narrow(1, 1, kSeq));
      auto storage = [](const at::Tensor& field) { return to_local(field).storage().nbytes(); };
      auto& wq = model->layers[0]->as<TransformerBlockImpl>()->attention->wq->weight;
      EXPECT_EQ(storage(wq), 0u) << "a block's gathered parameters are freed after its forward";
      EXPECT_GT(storage(model->output->weight), 0u) << "the root keeps its parameters for backward";
      EXPECT_EQ(comm.count(CollectiveType::AllGather, dp_ranks), L + 1);
      loss.backward();
      EXPECT_EQ(storage(wq), 0u);
      EXPECT_EQ(storage(model->output->weight), 0u) << "freed after backward";
      EXPECT_EQ(comm.count(CollectiveType::AllGather, dp_ranks), 2 * L + 1) << comm.str();
      EXPECT_EQ(comm.count(CollectiveType::ReduceScatter, dp_ranks), L + 1) << comm.str();
      EXPECT_EQ(comm.count(CollectiveType::AllReduce, dp_ranks), 0) << comm.str();
      EXPECT_EQ(comm.bytes(CollectiveType::AllGather, dp_ranks), 2 * block_bytes + root_bytes);
      EXPECT_EQ(comm.bytes(CollectiveType::ReduceScatter, dp_ranks), block_bytes + root_bytes);
      EXPECT_EQ(comm.count(CollectiveType::AllReduce, tp_ranks), want_tp[0] + (sp ? L : 0)) << comm.str();
      EXPECT_EQ(comm.count(CollectiveType::AllGather, tp_ranks), want_tp[1]) << comm.str();
      EXPECT_EQ(comm.count(CollectiveType::ReduceScatter, tp_ranks), want_tp[2]) << comm.str();
      EXPECT_EQ(comm.total_count(), 3 * L + 2 + want_tp[0] + want_tp[1] + want_tp[2] + (sp ? L : 0)) << comm.str();
    });
  }
}

// Per step: one all-reduce over dp per bucket, of the parameters' TP
// shards; on tp what TP alone issues, with the Partial gradients of norm
// weights (SP) summed once per bucket that holds any (TP alone: once).
TEST(ReplicateCollectives, PerStepMatchTheClosedForm) {
  for (bool sp : {true, false})
  for (double cap : {25.0, 1e-9}) {
    SCOPED_TRACE(std::string(sp ? "sp" : "no sp") + (cap > 1 ? " one bucket" : " a bucket per parameter"));
    LlamaConfig c = dtp::test::small_llama_config(2);
    run_ranks(4, [&](int) {
      auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
      const auto dp_ranks = mesh.get_group("dp").global_ranks(), tp_ranks = mesh.get_group("tp").global_ranks();
      at::Tensor batch = dtp::test::llama_batch(c.vocab_size, 0).narrow(0, mesh.get_local_rank("dp"), 1);
      auto step = [&](Llama& model, CommCounter& comm) {
        llama_loss(model(batch.narrow(1, 0, kSeq)), batch.narrow(1, 1, kSeq)).backward();
        return comm.count(CollectiveType::AllReduce, tp_ranks);
      };
      Llama tp_only(c);
      apply_tensor_parallel(tp_only, mesh, TensorParallelOptions{sp, kSeq});
      int64_t tp_all_reduces = 0, tp_total = 0;
      {
        CommCounter tp_comm;
        tp_all_reduces = step(tp_only, tp_comm);
        tp_total = tp_comm.total_count();
      }
      const int64_t bytes = tpShardBytes(*tp_only, false);

      Llama model(c);
      apply_tensor_parallel(model, mesh, TensorParallelOptions{sp, kSeq});
      apply_ddp(model, mesh, ReplicateOptions{cap});
      const int64_t buckets = static_cast<int64_t>(replicate_buckets(*model).size());
      const int64_t L = c.n_layers, norms = sp ? 2 * L + 1 : 0;
      CommCounter comm;
      const int64_t got_tp = step(model, comm);
      EXPECT_EQ(comm.count(CollectiveType::AllReduce, dp_ranks), buckets) << comm.str();
      EXPECT_EQ(comm.bytes(CollectiveType::AllReduce, dp_ranks), bytes) << comm.str();
      EXPECT_EQ(comm.total_count() - comm.count(CollectiveType::AllReduce, dp_ranks), tp_total - tp_all_reduces + got_tp);
      EXPECT_EQ(got_tp, tp_all_reduces + (cap > 1 ? 0 : norms - (sp ? 1 : 0))) << comm.str();
    });
  }
}

}  // namespace
