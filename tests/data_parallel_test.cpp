// 2-D parallelism: the reference Llama with TP on "tp" and fully_shard on
// "dp" of a (dp, tp) mesh, against the same model on one device training the
// whole batch; collectives per step against their closed form; the errors.
#include "close.h"
#include "dist.h"
#include "mesh/flatten.h"
#include "files.h"
#include "llama_util.h"

#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/models/checkpoint.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/optim/adamw.h"
#include "dtp/tp/legacy.h"
#include "dtp/tp/parallelize.h"
#include "dtp/module_utils.h"
#include "dtp/random.h"

#include <iostream>

#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

using namespace dtp;
using namespace dtp::models;
using dtp::test::kSeq;
using dtp::test::run_ranks;

namespace {

constexpr int kSteps = 20;

using dtp::test::Trace;

// 4 sequences per step, so that dp = 1, 2 and 4 split it evenly.
at::Tensor globalBatch(int64_t vocab, int step) {
  return at::cat({dtp::test::llama_batch(vocab, 2 * step), dtp::test::llama_batch(vocab, 2 * step + 1)});
}

// Trains steps [from, to) on this dp rank's rows of each global batch; the
// loss reported is the average over dp (equal token counts per rank).
std::vector<double> trainSteps(Llama& model, torch::optim::AdamW& opt, const ProcessGroup* dp, int from, int to) {
  std::vector<double> losses;
  for (int step = from; step < to; ++step) {
    at::Tensor batch = globalBatch(model->config.vocab_size, step);
    if (dp) batch = batch.narrow(0, dp->rank() * batch.size(0) / dp->size(), batch.size(0) / dp->size());
    at::Tensor loss = llama_loss(model(batch.narrow(1, 0, kSeq)), batch.narrow(1, 1, kSeq));
    opt.zero_grad();
    loss.backward();
    opt.step();
    at::Tensor l = (is_dtensor(loss) ? full_tensor(loss) : loss).detach().clone();
    losses.push_back((dp ? dp->all_reduce(l, ReduceOp::Avg).wait() : l).item<double>());
  }
  return losses;
}

Trace train(Llama& model, const ProcessGroup* dp) {
  return dtp::test::train_trace(model, kSteps, [dp](Llama& m, torch::optim::AdamW& opt, int from, int to) {
    return trainSteps(m, opt, dp, from, to);
  });
}

// NOTE: [Data-parallel parity tolerance] As NOTE: [Float64 parity
// tolerance]: data parallelism adds one more change of summation order (the
// average over dp of per-rank mean losses' gradients), so gradients differ
// from one device's by ~1e-17 and AdamW moves a weight by at most
// lr * 1e-17 / eps = 1e-11 per step: 2e-10 after 20 steps. A loss sees the
// weights' change times its gradient's L1 norm (< 10 here): 2e-9.
void expectSame(const Trace& got, const Trace& want) {
  constexpr double param_tol = kSteps * 1e-11, loss_tol = 10 * param_tol;
  dtp::test::expect_same_trace(got, want, loss_tol, param_tol);
}

struct Layout {
  int64_t dp, tp;
  bool sp;
};

void PrintTo(const Layout& l, std::ostream* os) {
  *os << "(dp " << l.dp << ", tp " << l.tp << (l.sp ? ", sp)" : ", no sp)");
}

class DataParallelTest : public ::testing::TestWithParam<Layout> {};

// 20 AdamW steps equal one device in float64, for (dp, tp) = (2, 2) with and
// without SP, (4, 1) and (1, 4); tied embeddings with dropout on (2, 2) and
// (4, 1). fully_shard and replicate (with one bucket per parameter, and with
// the default buckets).
TEST_P(DataParallelTest, TrainsLikeOneDeviceInFloat64) {
  const Layout l = GetParam();
  for (const char* how : {"fsdp", "ddp", "ddp-per-param"})
  for (bool tied : {false, true}) {
    SCOPED_TRACE(how);
    if (tied && l.dp == 1) continue;
    SCOPED_TRACE(tied ? "tied" : "untied");
    LlamaConfig c = dtp::test::small_llama_config(static_cast<int>(l.tp));
    c.dtype = at::kDouble;
    c.tie_embeddings = tied;
    c.dropout = tied ? 0.1 : 0.0;  // NOTE: [Random ops under data parallelism]
    Llama one(c);
    at::manual_seed(123);
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
      dtp::manual_seed(123);
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

// HSDP: fully_shard on (dp_replicate, dp_shard) = (2, 2), alone and with
// tp = 2 (SP) on top: 20 AdamW steps equal one device in float64, the batch
// split over both dp dimensions. With tp, tied embeddings and dropout: the
// masks are one device's (NOTE: [Random ops under data parallelism]: the
// draw spans both dp dimensions); without tp the activations are plain
// tensors, whose dropout ATen draws per rank, so that run has none.
// Parameters are [R, S(0)] on (dp_replicate, dp_shard), with tp [TP
// placement, R, S(0)] on (tp, dp_replicate, dp_shard). Per step:
// all-gathers and reduce-scatters over dp_shard as FSDP over dp, and one
// all-reduce (average) over dp_replicate per unit, of its shard: nothing
// else on dp_replicate.
TEST(FullyShardHsdp, TrainsLikeOneDeviceWithClosedFormCollectives) {
  for (int64_t tp : {1, 2}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    LlamaConfig c = dtp::test::small_llama_config(static_cast<int>(tp));
    c.dtype = at::kDouble;
    c.tie_embeddings = tp > 1;
    c.dropout = tp > 1 ? 0.1 : 0.0;
    Llama one(c);
    at::manual_seed(123);
    const Trace want = train(one, nullptr);
    run_ranks(static_cast<int>(4 * tp), [&](int) {
      const std::vector<std::string> names =
          tp == 1 ? std::vector<std::string>{"dp_replicate", "dp_shard"}
                  : std::vector<std::string>{"dp_replicate", "dp_shard", "tp"};
      auto mesh = init_device_mesh("cpu", tp == 1 ? std::vector<int64_t>{2, 2} : std::vector<int64_t>{2, 2, 2}, names);
      auto build = [&] {
        Llama model(c);
        if (tp > 1) apply_tensor_parallel(model, mesh, TensorParallelOptions{true, kSeq});
        apply_fsdp(model, mesh);
        return model;
      };
      Llama model = build();
      for (auto& [name, p] : model->unique_named_parameters()) {
        const Placements& pl = dtensor_spec(p).placements;
        ASSERT_EQ(pl.size(), static_cast<size_t>(tp > 1 ? 3 : 2)) << name;
        EXPECT_EQ(pl[pl.size() - 2], Replicate()) << name;
        EXPECT_EQ(pl.back(), Shard(0)) << name;
      }
      const ProcessGroup dp = flattened_group(mesh, {0, 1}, "test");  // fully_shard's own (made once)
      EXPECT_EQ(dp.size(), 4);
      EXPECT_EQ(dp.rank(), mesh.get_local_rank("dp_replicate") * 2 + mesh.get_local_rank("dp_shard"));
      dtp::manual_seed(123);
      expectSame(train(model, &dp), want);

      Llama counted = build();
      at::Tensor batch = globalBatch(c.vocab_size, 0).narrow(0, dp.rank(), 1);
      const auto shard = mesh.get_group("dp_shard").global_ranks(), rep = mesh.get_group("dp_replicate").global_ranks();
      const int64_t L = c.n_layers;
      for (int step = 0; step < 2; ++step) {
        CommCounter comm;
        llama_loss(counted(batch.narrow(1, 0, kSeq)), batch.narrow(1, 1, kSeq)).backward();
        if (step == 0) continue;  // the first step also syncs the generators
        EXPECT_EQ(comm.count(CollectiveType::AllGather, shard), 2 * L + 1) << comm.str();
        EXPECT_EQ(comm.count(CollectiveType::ReduceScatter, shard), L + 1) << comm.str();
        EXPECT_EQ(comm.count(CollectiveType::AllReduce, rep), L + 1) << comm.str();
        for (CollectiveType other : {CollectiveType::AllGather, CollectiveType::ReduceScatter, CollectiveType::Broadcast})
          EXPECT_EQ(comm.count(other, rep), 0) << comm.str();
      }
    });
  }
}

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
      auto* wq = model->layers[0]->as<TransformerBlockImpl>()->attention->wq.get();
      const at::Tensor sharded_wq = wq->named_parameters(false)["weight"];
      at::Tensor gathered_wq;  // what wq's forward read
      wq->post_hooks.push_back([&](dtp::nn::Slots&) { gathered_wq = wq->weight; });
      CommCounter comm;
      at::Tensor loss = llama_loss(model(batch.narrow(1, 0, kSeq)), batch.narrow(1, 1, kSeq));
      auto storage = [](const at::Tensor& t) { return to_local(t).storage().nbytes(); };
      EXPECT_EQ(storage(gathered_wq), 0u) << "a block's gathered parameters are freed after its forward";
      EXPECT_TRUE(wq->weight.is_same(sharded_wq)) << "and its fields show the sharded parameters again";
      const at::Tensor gathered_out = model->output->weight;
      EXPECT_GT(storage(gathered_out), 0u) << "the root keeps its parameters for backward";
      EXPECT_EQ(comm.count(CollectiveType::AllGather, dp_ranks), L + 1);
      loss.backward();
      EXPECT_EQ(storage(gathered_out), 0u) << "freed after backward";
      EXPECT_TRUE(model->output->weight.is_same(model->output->named_parameters(false)["weight"]));
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

// Each wrong composition is an error naming the thing and the fix, raised
// before anything changed.
TEST(DataParallelErrors, NameTheThingAndTheFix) {
  using dtp::test::expect_error;
  LlamaConfig c = dtp::test::small_llama_config(2);
  run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    {  // a 2-D mesh without the names
      Llama model(c);
      auto unnamed = init_device_mesh("cpu", {2, 2});
      expect_error([&] { apply_fsdp(model, unnamed); }, {"fully_shard", "not a data-parallel mesh", "\"dp\" and \"tp\""});
      expect_error([&] { apply_ddp(model, unnamed); }, {"replicate", "not a data-parallel mesh"});
      expect_error([&] { fully_shard(*model, DeviceMesh()); }, {"invalid DeviceMesh"});
    }
    {  // TP parameters on another mesh than the one passed
      Llama model(c);
      apply_tensor_parallel(model, mesh, TensorParallelOptions{true, kSeq});
      auto other = init_device_mesh("cpu", {4}, {"dp"});
      expect_error([&] { apply_fsdp(model, other); }, {"is a DTensor on", "no \"tp\" dimension", "mesh[\"tp\"]"});
      expect_error([&] { apply_ddp(model, other); }, {"is a DTensor on", "call replicate with that mesh"});
    }
    {  // data parallelism on a (dp, tp) mesh without the TP plan: named before anything changes
      Llama model(c);
      expect_error([&] { apply_fsdp(model, mesh); }, {"apply_fsdp: the mesh", "has a \"tp\" dimension, but no "
                                                      "parameter of the model is a DTensor", "mesh[\"dp\"]"});
      expect_error([&] { apply_ddp(model, mesh); }, {"apply_ddp: the mesh", "the TP plan was not applied"});
      for (const auto& p : model->parameters()) EXPECT_FALSE(is_dtensor(p));
    }
    {  // TP after fully_shard / replicate; data parallelism twice
      Llama model(c);
      for (size_t i = 0; i < model->layers->size(); ++i) fully_shard(*model->layers[i], mesh);
      fully_shard(*model, mesh);
      expect_error([&] { apply_tensor_parallel(model, mesh); },
                   {"parallelize_module", "already under fully_shard()", "Apply tensor parallelism first"});
      expect_error([&] { fully_shard(*model, mesh); }, {"already a fully_shard unit"});
      // Through the model's helpers the error names the entry point and the module's FQN.
      expect_error([&] { apply_fsdp(model, mesh); }, {"apply_fsdp: layers.0: fully_shard:", "already a fully_shard unit"});
      expect_error([&] { apply_ddp(model, mesh); }, {"apply_ddp: the model: replicate:", "already under fully_shard()"});
      Llama ddp(c);
      replicate(*ddp, mesh);
      expect_error([&] { apply_tensor_parallel(ddp, mesh); }, {"already under replicate()"});
      expect_error([&] { apply_fsdp(ddp, mesh); }, {"already under replicate()"});
    }
    {  // a parameter already sharded over dp
      Llama model(c);
      auto block = model->layers[0]->as<TransformerBlockImpl>();
      set_parameter(*block->attention_norm, "weight",
                    distribute_tensor(block->attention_norm->weight.detach(), mesh, {Shard(0), Replicate()}));
      expect_error([&] { fully_shard(*block, mesh); }, {"attention_norm.weight", "already sharded over \"dp\""});
    }
    {  // a module that runs no hooks
      torch::nn::Linear plain(4, 4);
      expect_error([&] { fully_shard(*plain, mesh); }, {"does not run hooks", "DTP_MODULE"});
      expect_error([&] { replicate(*plain, mesh); }, {"does not run hooks", "DTP_MODULE"});
    }
  });
}

// The full gradients of one forward and backward of the global batch's
// first step (dp ranks averaging their halves), in float64.
std::vector<std::pair<std::string, at::Tensor>> firstGradients(Llama& model, const ProcessGroup* dp) {
  at::Tensor batch = globalBatch(model->config.vocab_size, 0);
  if (dp) batch = batch.narrow(0, dp->rank() * batch.size(0) / dp->size(), batch.size(0) / dp->size());
  llama_loss(model(batch.narrow(1, 0, kSeq)), batch.narrow(1, 1, kSeq)).backward();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& [name, p] : model->unique_named_parameters())
    out.emplace_back(name, (is_dtensor(p) ? full_tensor(p.grad()) : p.grad()).to(at::kDouble));
  return out;
}

// NOTE: [Mixed-precision parity tolerance] With param_dtype bf16 no
// parallel run can equal one device bit for bit: each summation order rounds
// differently, by up to bf16's unit roundoff 2^-8 per operation. What it
// must be is as exact as one device under the same policy (fully_shard on a
// one-rank mesh: bf16 compute, float32 master weights and reduction). Both
// are measured against the float64 gradients of the same initial weights;
// (dp, tp) = (2, 2) may be up to 4x one device's own distance (another
// order: a random rounding of the same size; the max over a tensor varies by
// ~2x between orders), plus 16 bf16 ulps of the tensor's scale. The sharded
// (master) parameters and their gradients stay float32; forward sees bf16.
TEST(FullyShardMixedPrecision, Bf16IsAsExactAsOneDeviceWithTheSamePolicy) {
  LlamaConfig c = dtp::test::small_llama_config(2);
  FullyShardOptions mp;
  mp.mp_policy.param_dtype = at::kBFloat16;
  mp.mp_policy.reduce_dtype = at::kFloat;
  LlamaConfig c64 = c;
  c64.dtype = at::kDouble;
  Llama exact_model(c64);
  const auto exact = firstGradients(exact_model, nullptr);
  std::vector<std::pair<std::string, at::Tensor>> one, two_by_two;
  run_ranks(1, [&](int) {
    auto mesh = init_device_mesh("cpu", {1}, {"dp"});
    Llama model(c);
    apply_fsdp(model, mesh, mp);
    one = firstGradients(model, nullptr);
  });
  run_ranks(4, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    Llama model(c);
    apply_tensor_parallel(model, mesh, TensorParallelOptions{true, kSeq});
    apply_fsdp(model, mesh, mp);
    const ProcessGroup dp = mesh.get_group("dp");
    c10::ScalarType seen = at::kDouble;  // the head's weight as its forward read it
    model->output->post_hooks.push_back([&](dtp::nn::Slots&) { seen = model->output->weight.scalar_type(); });
    auto grads = firstGradients(model, &dp);
    EXPECT_EQ(seen, at::kBFloat16) << "forward computes in param_dtype";
    for (auto& [name, p] : model->unique_named_parameters()) {
      EXPECT_EQ(p.scalar_type(), at::kFloat) << name;
      EXPECT_EQ(p.grad().scalar_type(), at::kFloat) << name;
    }
    if (rank == 0) two_by_two = grads;
  });
  constexpr double u = 3.9e-3;  // bf16 unit roundoff, 2^-8
  ASSERT_EQ(two_by_two.size(), exact.size());
  double worst_ratio = 0;
  for (size_t i = 0; i < exact.size(); ++i) {
    const at::Tensor& x = exact[i].second;
    const double err = (two_by_two[i].second - x).abs().max().item<double>();
    const double one_err = (one[i].second - x).abs().max().item<double>();
    const double scale = x.abs().max().item<double>();
    EXPECT_LE(err, 4 * one_err + 16 * u * scale) << exact[i].first << ": one device " << one_err;
    EXPECT_GT(one_err, 0) << exact[i].first << ": bf16 compute must show in the gradients";
    worst_ratio = std::max(worst_ratio, err / std::max(one_err, 1e-30));
  }
  std::cout << "bf16 (2,2) error / one device's bf16 error, worst tensor: " << worst_ratio << "\n";
}

// The 2023 recipe ports unchanged: enable_2d_with_fsdp(), PairwiseParallel
// on an MLP over "tp", fully_shard over "dp"; two SGD steps equal one device.
struct MlpImpl : torch::nn::Module {
  dtp::nn::Linear up{register_module("up", dtp::nn::Linear(6, 10))};
  dtp::nn::Linear down{register_module("down", dtp::nn::Linear(10, 6))};
  at::Tensor forward(const at::Tensor& x) { return down(at::relu(up(x))); }
};
DTP_MODULE(Mlp);

TEST(DataParallel2023Api, PairwiseParallelWithFullyShardTrainsLikeOneDevice) {
  auto train = [](Mlp& m, const at::Tensor& x, const ProcessGroup* dp) {
    torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      at::Tensor rows = dp ? x.narrow(0, dp->rank() * 2, 2) : x;
      at::Tensor loss = m(rows).pow(2).mean();
      loss.backward();
      opt.step();
    }
    std::vector<at::Tensor> out;
    for (auto& p : m->parameters()) out.push_back(is_dtensor(p) ? full_tensor(p.detach()) : p.detach().clone());
    return out;
  };
  at::manual_seed(5);
  const at::Tensor x = at::randn({4, 6}, at::kDouble);
  Mlp one;
  one->to(at::kDouble);
  std::vector<at::Tensor> init;  // every rank starts from these (ATen's generator is shared by the rank threads)
  for (const auto& p : one->parameters()) init.push_back(p.detach().clone());
  const auto want = train(one, x, nullptr);
  run_ranks(4, [&](int) {
    ASSERT_TRUE(enable_2d_with_fsdp());
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    Mlp m;
    m->to(at::kDouble);
    {
      at::NoGradGuard no_grad;
      auto params = m->parameters();
      for (size_t i = 0; i < params.size(); ++i) params[i].copy_(init[i]);
    }
    parallelize_module(*m, mesh["tp"], PairwiseParallel());
    fully_shard(*m, mesh);
    const ProcessGroup dp = mesh.get_group("dp");
    const auto got = train(m, x, &dp);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_CLOSE(got[i], want[i], 0.0, 1e-14) << i;
  });
}

// Checkpoints hold full tensors: a run saved at (dp, tp) = (2, 2) under FSDP
// resumes at (1, 4), (4, 1), (2, 2) under DDP and on one device, and each
// ends where one device training all the steps ends.
class DataParallelCheckpointTest : public dtp::test::TempDirTest {};

TEST_F(DataParallelCheckpointTest, SavedAtTwoByTwoResumesInEveryLayout) {
  constexpr int kSave = 3, kEnd = 6;
  LlamaConfig c = dtp::test::small_llama_config(4);
  c.dtype = at::kDouble;
  Llama one(c);
  dtp::optim::AdamW one_opt(one->unique_parameters(), torch::optim::AdamWOptions(1e-2));
  const auto want_losses = trainSteps(one, one_opt, nullptr, 0, kEnd);
  const auto want = dtp::test::full_named_params(one);
  auto expectEnd = [&](const std::vector<double>& losses, const std::vector<std::pair<std::string, at::Tensor>>& got) {
    for (int i = kSave; i < kEnd; ++i) EXPECT_NEAR(losses[i - kSave], want_losses[i], 1e-12) << "step " << i;
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_CLOSE(got[i].second, want[i].second, 0.0, kEnd * 1e-11) << want[i].first;
  };
  const std::string path = file("dp2tp2.safetensors");
  run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    Llama model(c);
    apply_tensor_parallel(model, mesh, TensorParallelOptions{true, kSeq});
    apply_fsdp(model, mesh);
    dtp::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
    const ProcessGroup dp = mesh.get_group("dp");
    trainSteps(model, opt, &dp, 0, kSave);
    save_checkpoint(path, model, opt, kSave);
  });
  struct To {
    int64_t dp, tp;
    bool ddp;
  };
  for (To to : {To{1, 4, false}, To{4, 1, false}, To{2, 2, true}}) {
    SCOPED_TRACE("dp " + std::to_string(to.dp) + " tp " + std::to_string(to.tp) + (to.ddp ? " ddp" : ""));
    run_ranks(4, [&](int) {
      auto mesh = init_device_mesh("cpu", {to.dp, to.tp}, {"dp", "tp"});
      Llama model(c);
      apply_tensor_parallel(model, mesh, TensorParallelOptions{true, kSeq});
      if (to.dp > 1) {
        if (to.ddp) apply_ddp(model, mesh);
        else apply_fsdp(model, mesh);
      }
      dtp::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
      EXPECT_EQ(load_checkpoint(path, model, &opt), kSave);
      const ProcessGroup dp = mesh.get_group("dp");
      const auto losses = trainSteps(model, opt, to.dp > 1 ? &dp : nullptr, kSave, kEnd);
      expectEnd(losses, dtp::test::full_named_params(model));
    });
  }
  Llama model(c);
  dtp::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
  EXPECT_EQ(load_checkpoint(path, model, &opt), kSave);
  const auto losses = trainSteps(model, opt, nullptr, kSave, kEnd);
  expectEnd(losses, dtp::test::full_named_params(model));
}

}  // namespace
