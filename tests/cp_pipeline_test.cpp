// Context parallelism inside a pipeline (#58): pipeline_llama on a mesh with
// "pp" and "cp" (and "tp", "ep", and a data-parallel dimension) gives one step's
// loss and every parameter's gradient of one device on the whole batch, in
// float64: each stage's attention over cp, the batch cut by
// context_parallel_shard_batch on the whole model before the microbatches,
// the loss weighted per stage (NOTE: [Context parallelism in a pipeline] in
// src/models/llama_cp.cpp). On every rank the step's messages equal the
// closed form: per microbatch and layer of its stage, ring attention's
// cp - 1 send/recv pairs forward and 2*cp - 1 backward, or all-to-all's 4
// all_to_alls each way, plus the pipeline's own (m activations and one
// shape message out of the first stage, m gradients back out of the last).
//
// The bound, 1e-12 absolute, as tests/cp_llama_test.cpp derives it: the
// loss is ln(vocab) ~ 4.2, the gradients below 1; the cp run reorders a few
// float64 sums (attention merged over 2*cp blocks, gradients summed over cp
// and over microbatches, the loss weighted, averaged over ranks), each a few
// tens of unit roundoffs (u = 1.1e-16): ~1e-14, a margin of 100. A missing
// loss weight (S = 13 over cp 2: weights 7*2/13 and 6*2/13), a stage without
// cp attention, or positions cut after the microbatch split moves results by
// 1e-4 or more.
#include "cp_step.h"
#include "dist.h"
#include "llama_util.h"

#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/parallel_dims.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
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

LlamaConfig config() {
  LlamaConfig c = dtp::test::small_llama_config(2);  // 4 heads over 2 KV heads: GQA
  c.n_layers = 4;                                    // 2 per stage
  c.dtype = at::kDouble;
  c.max_seq_len = 32;
  return c;
}

at::Tensor batchOf(int64_t vocab, int64_t seq) { return dtp::test::cp_batch(vocab, seq, 23); }

struct Layout {
  std::string what;
  ParallelDims dims;
  ContextParallelOptions cp;
  PipelineOptions pipeline;
  int64_t seq = 16;
  DataParallel data_parallel = DataParallel::FSDP;
  LlamaConfig config = ::config();
  bool aux = false;  // the MoE load-balancing loss over the step (LlamaPipeline::add_load_balancing_loss)
  bool ac = false;   // full activation checkpointing in every stage
};

// Mixtral-shaped: a MoE in every block, 4 experts, top 2; with
// `aux_loss_coef`, the load-balancing loss of GPipe layouts with aux.
LlamaConfig moeConfig(double aux_loss_coef = 0) {
  LlamaConfig c = dtp::test::mixtral_like(config());
  c.moe.aux_loss_coef = aux_loss_coef;
  return c;
}

DeviceMesh withoutPp(const DeviceMesh& mesh) {
  std::vector<std::string> names;
  for (const auto& n : mesh.mesh_dim_names())
    if (n != "pp") names.push_back(n);
  return mesh[names];
}

void expectStepEqualsOneDevice(const Layout& l) {
  SCOPED_TRACE(l.what);
  const LlamaConfig& c = l.config;
  const dtp::test::CpStep want = dtp::test::cp_one_device_step(c, batchOf(c.vocab_size, l.seq), l.aux);
  ParallelDims dims = l.dims;
  dims.validate();
  const int64_t world = dims.world_size(), cp = dims.cp(), pp = dims.pp(), ep = std::max<int64_t>(dims.ep(), 1);
  const int64_t layers = c.n_layers / pp, m = l.pipeline.microbatches;
  std::mutex mu;
  double worst = 0;
  run_ranks(static_cast<int>(world), [&](int rank) {
    SCOPED_TRACE(l.what + " rank " + std::to_string(rank));
    const DeviceMesh mesh = dims.build_mesh();
    Llama full(c);
    ParallelizeOptions options;
    options.cp = l.cp;
    options.data_parallel = l.data_parallel;
    if (l.ac) options.ac = ACOptions{ACMode::Full};
    const LlamaPipeline pipe = pipeline_llama(full, mesh, l.pipeline, options);
    ASSERT_EQ(pipe.stages.size(), 1u);
    const bool first = mesh.get_local_rank("pp") == 0, last = pipe.has_last_stage;
    const ProcessGroup rows = dims.dp_enabled() ? data_parallel_group(withoutPp(mesh)) : ProcessGroup();
    if (l.aux) pipe.add_load_balancing_loss(rows.valid() ? std::optional<ProcessGroup>(rows) : std::nullopt);
    // The data loader: this dp rank's rows, then this cp rank's positions.
    const at::Tensor b = dtp::test::cp_rows(batchOf(c.vocab_size, l.seq), rows);
    const auto in = context_parallel_shard_batch(full, {b.narrow(1, 0, l.seq), b.narrow(1, 1, l.seq)});
    EXPECT_LT(in[0].size(1), l.seq) << "the batch is cut to this cp rank's positions";
    if (l.aux) {  // an evaluation (no grad) before the step adds nothing to the step's routing counts
      at::NoGradGuard evaluation;
      Llama stage = pipe.stages[0];
      stage(first ? in[0] : at::ones({in[0].size(0), in[0].size(1), c.dim}, at::kDouble));
    }
    CommCounter comm;
    const at::Tensor loss = pipe.pipeline->step(in[0], in[1]);
    const bool ring = l.cp.attention == ContextParallelAttention::Ring;
    // The pipeline's messages: m activations (after one shape message) out
    // of the first stage, m gradients out of the last; and in, alike.
    const int64_t pipe_sends = first ? m + 1 : m, pipe_recvs = last ? m + 1 : m;
    // Under activation checkpointing each forward's messages come again in
    // the recomputation.
    const int64_t forwards = l.ac ? 2 : 1;
    const int64_t ring_msgs = ring ? m * layers * (forwards * (cp - 1) + 2 * cp - 1) : 0;
    EXPECT_EQ(comm.count(CollectiveType::Send), pipe_sends + ring_msgs)
        << "ring: (cp - 1) forward (again when recomputed) + (2 cp - 1) backward sends per microbatch and layer; "
        << comm.str();
    EXPECT_EQ(comm.count(CollectiveType::Recv), pipe_recvs + ring_msgs) << comm.str();
    // Expert parallelism over ep x cp: dispatch and combine forward and
    // backward, per microbatch and MoE layer.
    const int64_t moe_a2a = ep > 1 ? m * layers * (2 * forwards + 2) : 0;
    EXPECT_EQ(comm.count(CollectiveType::AllToAll), (ring ? 0 : m * layers * (4 * forwards + 4)) + moe_a2a)
        << "all-to-all: 4 forward (again when recomputed) and 4 backward per microbatch and layer; " << comm.str();
    // The load-balancing loss: one all_reduce over pp, two over the rows and
    // one over cp per step (FSDP reduces gradients by reduce_scatter; DDP's
    // all_reduces would count here).
    if (l.aux && l.data_parallel == DataParallel::FSDP) {
      const int64_t want = 1 + (rows.valid() && rows.size() > 1 ? 2 : 0) + (cp > 1 ? 1 : 0);
      EXPECT_EQ(comm.count(CollectiveType::AllReduce), want) << comm.str();
    }
    // This rank's stage's parameters, by the whole model's names.
    std::set<const void*> mine;
    for (const auto& p : pipe.parameters()) mine.insert(p.unsafeGetTensorImpl());
    std::vector<std::pair<std::string, at::Tensor>> params;
    for (const auto& item : full->named_parameters())
      if (mine.count(item.value().unsafeGetTensorImpl())) params.emplace_back(item.key(), item.value());
    // The loss: on the last stage's ranks, each its cp rank's weighted share;
    // their mean over the world / pp ranks (tp ranks hold the same value) is
    // the whole batch's.
    const double err = dtp::test::expect_cp_step_equals(loss, world / pp, params, want, kTol);
    std::lock_guard<std::mutex> lock(mu);
    worst = std::max(worst, err);
  });
  std::printf("  %s: max |pp x cp - one device| over the loss and the gradients %.3g\n", l.what.c_str(), worst);
}

TEST(CpPipelineTest, PpCpStepEqualsOneDevice) {
  // S = 13: the cp ranks hold 7 and 6 positions, so each stage's loss weight matters.
  expectStepEqualsOneDevice({"(pp, cp) = (2, 2), ring, 1F1B m=2, S 13", ParallelDims().pp(2).cp(2).world_size(4),
                             cp_ring(), {"1f1b", 2}, 13});
  expectStepEqualsOneDevice({"(pp, cp) = (2, 2), all-to-all, GPipe m=4", ParallelDims().pp(2).cp(2).world_size(4),
                             cp_all_to_all(), {"gpipe", 4}});
  expectStepEqualsOneDevice({"(pp, cp) = (2, 2), ring, Contiguous, 1F1B m=2, S 13",
                             ParallelDims().pp(2).cp(2).world_size(4), cp_ring(CpLayout::Contiguous), {"1f1b", 2}, 13,
                             DataParallel::DDP});
}

TEST(CpPipelineTest, PpCpTpStepEqualsOneDevice) {
  // Heads by tp (2 query, 1 KV head per rank), the sequence by cp, layers by pp.
  expectStepEqualsOneDevice({"(pp, cp, tp) = (2, 2, 2), ring, 1F1B m=2, S 13",
                             ParallelDims().pp(2).cp(2).tp(2).world_size(8), cp_ring(), {"1f1b", 2}, 13});
  expectStepEqualsOneDevice({"(pp, cp, tp) = (2, 2, 2), all-to-all, 1F1B m=2",
                             ParallelDims().pp(2).cp(2).tp(2).world_size(8), cp_all_to_all(), {"1f1b", 2}});
  // FSDP over dp_shard_cp = (dp_shard, cp) inside each stage; each dp rank 2 rows.
  expectStepEqualsOneDevice({"(pp, dp, cp) = (2, 2, 2) FSDP, ring, 1F1B m=2, S 13",
                             ParallelDims().pp(2).dp_shard(2).cp(2).world_size(8), cp_ring(), {"1f1b", 2}, 13});
}

// (pp, cp, ep): each stage's experts spread over ep x cp (NOTE: [Context
// parallelism with expert parallelism]), its attention over cp.
TEST(CpPipelineTest, PpCpEpStepEqualsOneDevice) {
  Layout ring{"(pp, cp, ep) = (2, 2, 2), ring, 1F1B m=2, S 13", ParallelDims().pp(2).cp(2).ep(2).world_size(4),
              cp_ring(), {"1f1b", 2}, 13};
  ring.config = moeConfig();
  expectStepEqualsOneDevice(ring);
  Layout a2a{"(pp, dp, cp, ep) = (2, 2, 2, 4) DDP, all-to-all, GPipe m=2",
             ParallelDims().pp(2).dp_shard(2).cp(2).ep(4).world_size(8), cp_all_to_all(), {"gpipe", 2}, 16,
             DataParallel::DDP};
  a2a.config = moeConfig();
  expectStepEqualsOneDevice(a2a);
}

// The load-balancing loss over a GPipe step (NOTE: [Load-balancing loss in a
// pipeline]): every stage's routers get one device's gradient of HF's loss
// on the whole batch, its counts summed over microbatches, pp, the rows and
// cp; with the experts replicated (and every stage checkpointed: the
// recomputation reads the first pass's routing), and over ep x cp with dp.
TEST(CpPipelineTest, LoadBalancingLossOverAGPipeStepEqualsOneDevice) {
  Layout replicated{"(pp, cp) = (2, 2), experts replicated, aux, AC, GPipe m=2, S 13",
                    ParallelDims().pp(2).cp(2).world_size(4), cp_ring(), {"gpipe", 2}, 13};
  replicated.config = moeConfig(0.05);
  replicated.aux = replicated.ac = true;
  expectStepEqualsOneDevice(replicated);
  Layout ep{"(pp, dp, cp, ep) = (2, 2, 2, 4) DDP, aux, GPipe m=2", ParallelDims().pp(2).dp_shard(2).cp(2).ep(4).world_size(8),
            cp_all_to_all(), {"gpipe", 2}, 16, DataParallel::DDP};
  ep.config = moeConfig(0.05);
  ep.aux = true;
  expectStepEqualsOneDevice(ep);
}

// Under 1F1B the last stage's first backward precedes its second forward:
// the loss over the whole step is refused, naming both and GPipe.
TEST(CpPipelineTest, LoadBalancingLossUnder1F1BIsRefused) {
  run_ranks(2, [](int) {
    const DeviceMesh mesh = ParallelDims().pp(2).world_size(2).build_mesh();
    Llama full(moeConfig(0.05));
    const LlamaPipeline pipe = pipeline_llama(full, mesh, {"1f1b", 2});
    expect_error([&] { pipe.add_load_balancing_loss(); }, {"runs 1B0 on pp rank 1 before 1F1", "GPipe"});
  });
}

}  // namespace
