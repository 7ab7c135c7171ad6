// Context parallelism composed with expert parallelism (#58, NOTE: [Context
// parallelism with expert parallelism]): parallelize_llama on ParallelDims'
// (dp_shard_mod_ep, dp_shard_in_ep, cp[, tp]) mesh, the experts spread over
// torchtitan's ep = dp_shard_in_ep x cp, gives one training step's loss (the
// language-model loss plus the load-balancing loss) and every parameter's
// gradient of one device on the whole batch and sequences, in float64: ep =
// cp = 2, (dp_shard_in_ep, cp) = (2, 2) at ep 4, (dp_shard_mod_ep, cp) =
// (2, 2) at ep 2 (the experts data parallel over dp), with tp, on a
// hand-built (dp, ep, cp) mesh; ring and all-to-all attention, FSDP and DDP,
// even and uneven sequences (S = 16, 13 with HeadTail). The load-balancing
// loss's counts are summed over cp (one all_reduce), which also makes the
// experts-replicated case (cp without ep) exact. Each MoE layer's
// all-to-alls per step equal the closed form; what does not divide or
// compose errors.
//
// The bound, 1e-12 absolute, as tests/cp_llama_test.cpp's: one device and
// the parallel run do the same float64 operations but for the order of a
// few sums (attention merged over cp blocks, an expert's rows from several
// ranks, the gradients summed over dp x cp), ~1e-14. Both ways to get it
// wrong were tried: the experts' divide factor halved (dp x ep instead of
// dp x ep x cp) doubles their gradients (off by 5.6e-4 at ep = cp = 2), and
// load-balancing counts of this cp rank's positions alone move the loss by
// 1e-5 to 2e-4 and every gradient upstream of the routers.
#include "cp_step.h"
#include "dist.h"
#include "llama_util.h"

#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/models/llama.h"
#include "dtp/models/moe.h"
#include "dtp/models/parallelize.h"
#include "dtp/parallel_dims.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace {

using namespace dtp;
using namespace dtp::models;
using dtp::test::expect_error;
using dtp::test::cp_all_to_all;
using dtp::test::cp_ring;
using dtp::test::run_ranks;

constexpr double kTol = 1e-12;  // see the bound above

// Mixtral-shaped in float64: a MoE in every block, 4 experts, top 2, and a
// load-balancing loss large enough to move the routers' gradients; with
// `shared`, Qwen2-MoE's gated shared expert of that width too.
LlamaConfig config(int64_t shared = 0) {
  LlamaConfig c = dtp::test::small_llama_config(2);  // 4 heads over 2 KV heads: GQA
  c.dtype = at::kDouble;
  c.max_seq_len = 32;
  c.family = shared > 0 ? "qwen2_moe" : "mixtral";
  c.moe.num_experts = 4;
  c.moe.top_k = 2;
  c.moe.hidden = 12;
  c.moe.norm_topk_prob = true;
  c.moe.shared_hidden = shared;
  c.moe.aux_loss_coef = 0.1;
  return c;
}

at::Tensor batchOf(int64_t vocab, int64_t seq) { return dtp::test::cp_batch(vocab, seq, 23); }

struct Layout {
  std::string what;
  ParallelDims dims;
  ContextParallelOptions cp;
  DataParallel data_parallel = DataParallel::FSDP;
  int64_t seq = 16;
  LlamaConfig config = ::config();
  // Not empty: a hand-built mesh of dims' shape under these names.
  std::vector<std::string> names = {};
};

// One training step on `l.dims`' mesh against one device: the loss (the mean
// over the dp x cp ranks of each rank's weighted language-model loss plus its
// load-balancing term) and every parameter's full gradient within kTol. Per
// step, each MoE layer's all-to-alls are 2 forward (dispatch, combine) and 2
// backward over the ep x cp ranks, all-to-all attention adds 4 each way per
// layer; the load-balancing loss issues data_parallel's 2 all_reduces and one
// over cp.
void expectOneStepEqualsOneDevice(const Layout& l) {
  SCOPED_TRACE(l.what);
  // One device: the mean over the B*S tokens plus the load-balancing loss of
  // every token of every layer.
  const dtp::test::CpStep want =
      dtp::test::cp_one_device_step(l.config, batchOf(l.config.vocab_size, l.seq), /*aux=*/true);
  ParallelDims dims = l.dims;
  dims.validate();
  const int64_t world = dims.world_size(), cp = dims.cp(), ep = std::max<int64_t>(dims.ep(), 1),
                layers = l.config.n_layers, E = l.config.moe.num_experts;
  const bool a2a_attention = l.cp.attention == ContextParallelAttention::AllToAll;
  std::mutex mu;
  double worst = 0;
  run_ranks(static_cast<int>(world), [&](int rank) {
    SCOPED_TRACE(l.what + " rank " + std::to_string(rank));
    const DeviceMesh mesh = l.names.empty() ? dims.build_mesh() : init_device_mesh("cpu", dims.mesh_shape(), l.names);
    Llama model(l.config);
    ParallelizeOptions options;
    options.cp = l.cp;
    options.data_parallel = l.data_parallel;
    parallelize_llama(model, mesh, options);
    MoEImpl* moe = model->layers[0]->as<TransformerBlockImpl>()->moe.get();
    ASSERT_NE(moe, nullptr);
    if (ep > 1) {
      ASSERT_TRUE(moe->ep_mesh.has_value());
      EXPECT_EQ(moe->ep_mesh->size(), ep) << "the experts spread over ep = dp_shard_in_ep x cp";
      const int64_t dp_mod = dims.dp_shard() * cp / ep;
      EXPECT_EQ(to_local(moe->experts->w1).size(0) * ep * (l.data_parallel == DataParallel::FSDP ? dp_mod : 1), E)
          << "each rank's experts, under FSDP cut over dp_shard_mod_ep";
    } else {
      EXPECT_FALSE(moe->ep_mesh.has_value());
    }
    // The data loader: this dp rank's rows (never cut over cp), then this cp
    // rank's positions.
    const ParallelMeshDims parts = parallel_mesh_dims(mesh);
    const std::optional<ProcessGroup> dp =
        parts.batch.empty() ? std::nullopt : std::optional<ProcessGroup>(data_parallel_group(mesh));
    const at::Tensor b = dtp::test::cp_rows(batchOf(l.config.vocab_size, l.seq), dp.value_or(ProcessGroup()));
    const auto in = context_parallel_shard_batch(model, {b.narrow(1, 0, l.seq), b.narrow(1, 1, l.seq)});
    CommCounter comm;
    at::Tensor loss = llama_loss(model, model(in[0]), in[1]);
    at::Tensor aux;
    {
      CommCounter aux_comm;
      aux = moe_load_balancing_loss(model, dp);
      EXPECT_EQ(aux_comm.count(CollectiveType::AllReduce), (dp && dp->size() > 1 ? 2 : 0) + 1)
          << "the counts over dp, then (routed, tokens) packed over cp: " << aux_comm.str();
      EXPECT_EQ(aux_comm.count(CollectiveType::AllReduce, model->context_parallel->group.global_ranks()), 1)
          << "one over cp: " << aux_comm.str();
    }
    loss = loss + aux;
    const int64_t forward_a2a = comm.count(CollectiveType::AllToAll);
    loss.backward();
    const int64_t moe_a2a = ep > 1 ? 2 * layers : 0, attention_a2a = a2a_attention ? 4 * layers : 0;
    EXPECT_EQ(forward_a2a, moe_a2a + attention_a2a) << "forward: dispatch and combine per MoE layer" << comm.str();
    EXPECT_EQ(comm.count(CollectiveType::AllToAll) - forward_a2a, moe_a2a + attention_a2a)
        << "backward: both again per MoE layer" << comm.str();
    // The loss of the whole batch: every rank's share averaged over the world
    // (tp ranks hold the same value, so the world's mean is dp x cp's).
    const double err = dtp::test::expect_cp_step_equals(loss, world, model->unique_named_parameters(), want, kTol);
    std::lock_guard<std::mutex> lock(mu);
    worst = std::max(worst, err);
  });
  std::printf("  %s: max |parallel - one device| over the loss and the gradients %.3g\n", l.what.c_str(), worst);
}

// ep = cp = 2 on 2 ranks: ParallelDims' (dp_shard_mod_ep, dp_shard_in_ep, cp)
// = (1, 1, 2), every MoE layer's experts 2 per cp rank, the tokens of both
// cp ranks' positions dispatched among them.
TEST(CpMoeTest, EpEqualToCpStepEqualsOneDevice) {
  expectOneStepEqualsOneDevice({"ep = cp = 2, ring, S 16, FSDP", ParallelDims().cp(2).ep(2).world_size(2), cp_ring()});
  expectOneStepEqualsOneDevice(
      {"ep = cp = 2, ring, S 13 (uneven), DDP", ParallelDims().cp(2).ep(2).world_size(2), cp_ring(), DataParallel::DDP, 13});
  expectOneStepEqualsOneDevice(
      {"ep = cp = 2, all-to-all, S 13, FSDP", ParallelDims().cp(2).ep(2).world_size(2), cp_all_to_all(), DataParallel::FSDP, 13});
}

// 4 ranks: (dp_shard, cp) = (2, 2) with ep 4 = (dp_shard_in_ep 2) x (cp 2),
// one expert per rank; and with ep 2 = cp, the experts data parallel over
// dp_shard_mod_ep 2 (FSDP cuts each rank's 2 experts over it).
TEST(CpMoeTest, EpOverDpAndCpStepEqualsOneDevice) {
  const ParallelDims ep4 = ParallelDims().dp_shard(2).cp(2).ep(4).world_size(4);
  expectOneStepEqualsOneDevice({"(dp, cp) = (2, 2), ep 4, ring, S 13, FSDP", ep4, cp_ring(), DataParallel::FSDP, 13});
  expectOneStepEqualsOneDevice({"(dp, cp) = (2, 2), ep 4, ring, S 16, DDP", ep4, cp_ring(), DataParallel::DDP});
  Layout shared{"(dp, cp) = (2, 2), ep 4, all-to-all, S 13, FSDP, shared expert", ep4, cp_all_to_all(), DataParallel::FSDP,
                13, config(10)};
  expectOneStepEqualsOneDevice(shared);
  const ParallelDims ep2 = ParallelDims().dp_shard(2).cp(2).ep(2).world_size(4);
  expectOneStepEqualsOneDevice({"(dp_shard_mod_ep, cp) = (2, 2), ep 2, ring, S 13, FSDP", ep2, cp_ring(),
                                DataParallel::FSDP, 13});
  expectOneStepEqualsOneDevice({"(dp_shard_mod_ep, cp) = (2, 2), ep 2, ring, S 13, DDP", ep2, cp_ring(),
                                DataParallel::DDP, 13});
  // A hand-built (dp, ep, cp) reads alike: parallelize_llama flattens (ep,
  // cp) as "ep_cp" (its own "ep" takes the name) and (dp, ep, cp) as
  // "dp_shard_cp".
  Layout hand{"hand-built (dp, ep, cp) = (1, 2, 2), ep 4, ring, S 13", ep4, cp_ring(), DataParallel::FSDP, 13};
  hand.names = {"dp", "ep", "cp"};
  expectOneStepEqualsOneDevice(hand);
}

// (ep = cp = 2, tp 2): heads by tp, the sequence by cp, the experts over cp
// and replicated over tp.
TEST(CpMoeTest, ComposesWithTensorParallelism) {
  expectOneStepEqualsOneDevice({"ep = cp = 2, tp 2, ring, S 13, FSDP", ParallelDims().cp(2).ep(2).tp(2).world_size(4),
                                cp_ring(), DataParallel::FSDP, 13});
}

// Without ep the experts are replicated and data parallel over dp x cp like
// every parameter; the load-balancing loss's counts still need every cp
// rank's positions (NOTE: [Load-balancing loss under context parallelism]).
TEST(CpMoeTest, ReplicatedExpertsWithTheLoadBalancingLossStepEqualsOneDevice) {
  expectOneStepEqualsOneDevice({"cp 2, experts replicated, ring, S 13", ParallelDims().cp(2).world_size(2), cp_ring(),
                                DataParallel::FSDP, 13});
  expectOneStepEqualsOneDevice({"(dp, cp) = (2, 2), experts replicated, DDP, S 13",
                                ParallelDims().dp_shard(2).cp(2).world_size(4), cp_ring(), DataParallel::DDP, 13});
}

TEST(CpMoeTest, WhatDoesNotDivideOrComposeErrors) {
  // ParallelDims: ep borrows from dp_shard x cp, whole cp groups.
  expect_error([] { ParallelDims().cp(2).ep(3).world_size(6).validate(); },
               {"ep(3) borrows from dp_shard(3) * cp(2) = 6", "multiples of cp"});
  expect_error([] { ParallelDims().cp(2).ep(4).world_size(2).validate(); },
               {"ep(4) borrows from dp_shard(1) * cp(2) = 2", "divide dp_shard * cp"});
  run_ranks(4, [&](int) {
    {
      SCOPED_TRACE("a hand-built mesh without dp, or with cp before ep");
      for (const auto& [shape, names] :
           {std::pair<std::vector<int64_t>, std::vector<std::string>>{{2, 2}, {"ep", "cp"}},
            std::pair<std::vector<int64_t>, std::vector<std::string>>{{1, 2, 2}, {"dp", "cp", "ep"}}}) {
        Llama model(config());
        const DeviceMesh mesh = init_device_mesh("cpu", shape, names);
        expect_error([&] { parallelize_llama(model, mesh); },
                     {"parallelize_llama", "with \"cp\" after \"ep\" under context parallelism"});
      }
    }
    {
      SCOPED_TRACE("all-to-all attention with heads that do not divide");
      LlamaConfig c = config();
      c.n_heads = 6;
      c.dim = 48;
      Llama model(c);
      ParallelizeOptions o;
      o.cp = cp_all_to_all();
      expect_error([&] { parallelize_llama(model, ParallelDims().cp(2).ep(2).tp(2).world_size(4).build_mesh(), o); },
                   {"parallelize_llama: all-to-all attention over cp 2 with 3 query heads per rank"});
    }
  });
}

}  // namespace
