// CommCounter as PyTorch's CommDebugMode (#27): collectives attributed to the
// module whose forward or backward issued them, by FQN and pass, and to the
// ATen op that issued them; the JSON dump and the tracing table. Expected
// counts are PyTorch's documented ones for its styles: Colwise has none in
// forward and one all-reduce of the input gradient in backward; Rowwise one
// all-reduce of the output in forward and none in backward; a
// SequenceParallel norm none in forward or backward (its weight's gradient
// is reduced with the other replicated parameters' after the backward);
// loss_parallel three all-reduces in forward and none in backward.
#include "dist.h"
#include "llama_util.h"
#include "parity.h"

#include "dtp/comm_counter.h"
#include "dtp/models/parallelize.h"
#include "dtp/nn/modules.h"
#include "dtp/tp/loss_parallel.h"
#include "dtp/tp/parallelize.h"
#include "dtp/tp/style.h"

#include <torch/nn/functional/loss.h>

using namespace dtp;
using dtp::test::data;
using dtp::test::run_ranks;

namespace {

struct MlpImpl : torch::nn::Module {
  dtp::nn::RMSNorm norm{register_module("norm", dtp::nn::RMSNorm(8, 1e-6))};
  dtp::nn::Linear up{register_module("up", dtp::nn::Linear(8, 12))};
  dtp::nn::Linear down{register_module("down", dtp::nn::Linear(12, 8))};
  at::Tensor forward(const at::Tensor& x) { return down(at::relu(up(norm(x)))); }
};
DTP_MODULE(Mlp);

using Counts = std::map<std::string, std::map<std::string, int64_t>>;

TEST(CommDebug, ColwiseRowwiseAttributedToModuleAndPass) {
  run_ranks(2, [](int rank) {
    const auto mesh = init_device_mesh("cpu", {2});
    Mlp m;
    m->to(at::kDouble);
    parallelize_module(*m, mesh, {{"up", ColwiseParallel()}, {"down", RowwiseParallel()}});
    const at::Tensor x = data({3, 8}).requires_grad_();
    CommDebugMode comm;
    m(x).sum().backward();
    EXPECT_EQ(comm.per_module(Pass::Forward), (Counts{{"down", {{"all_reduce", 1}}}})) << comm.tracing_table();
    EXPECT_EQ(comm.per_module(Pass::Backward), (Counts{{"up", {{"all_reduce", 1}}}})) << comm.tracing_table();
    // The forward all-reduce is down's output layout (an explicit
    // redistribution), the backward one the input gradient's.
    const std::string table = comm.tracing_table();
    if (rank == 0) std::printf("%s%s\n", table.c_str(), comm.to_json().c_str());
    for (const char* part : {"Global\n", "  Module: down\n    FORWARD PASS\n      **(explicit)\n        *all_reduce: 1 (",
                             "  Module: up\n    BACKWARD PASS\n"}) {
      EXPECT_NE(table.find(part), std::string::npos) << part << "\nin\n" << table;
    }
    const std::string json = comm.to_json();
    for (const char* part : {"\"total\": {\"count\": 2, \"bytes\": ", "\"down\": {\"forward\": {\"all_reduce\": {\"count\": 1",
                             "\"up\": {\"backward\": {\"all_reduce\": {\"count\": 1"}) {
      EXPECT_NE(json.find(part), std::string::npos) << part << "\nin\n" << json;
    }
    // A collective that sharding propagation inserts is the op's.
    const at::Tensor a = distribute_tensor(data({4, 6}), mesh, {Shard(0)});
    const at::Tensor b = distribute_tensor(data({4, 6}), mesh, {Shard(1)});
    CommDebugMode ops;
    (void)(a + b);
    const auto records = ops.records();
    ASSERT_EQ(records.size(), 1u) << ops.tracing_table();
    EXPECT_EQ(records[0].op, "aten::add.Tensor");
    EXPECT_EQ(records[0].type, CollectiveType::AllToAll);
    EXPECT_EQ(records[0].pass, Pass::Forward);
    EXPECT_EQ(records[0].module, "");
  });
}

TEST(CommDebug, SequenceParallelAndLossParallel) {
  run_ranks(2, [](int) {
    const auto mesh = init_device_mesh("cpu", {2});
    Mlp m;
    m->to(at::kDouble);
    parallelize_module(*m, mesh,
                       {{"norm", SequenceParallel(SequenceParallelOptions().sequence_dim(0))},  // x is [seq, hidden]
                        {"up", ColwiseParallel(ColwiseParallelOptions().input_layouts(Shard(0)))},
                        {"down", RowwiseParallel(RowwiseParallelOptions().output_layouts(Shard(0)))}});
    const at::Tensor x = distribute_tensor(data({4, 8}), mesh, {Shard(0)}).detach().requires_grad_();
    CommDebugMode comm;
    m(x).sum().backward();
    // up gathers the sequence (forward) and reduce-scatters its input
    // gradient (backward); down the reverse; the norm none.
    EXPECT_EQ(comm.per_module(Pass::Forward),
              (Counts{{"up", {{"all_gather", 1}}}, {"down", {{"reduce_scatter", 1}}}})) << comm.tracing_table();
    const Counts backward = comm.per_module(Pass::Backward);
    EXPECT_EQ(backward.at("up"), (std::map<std::string, int64_t>{{"reduce_scatter", 1}})) << comm.tracing_table();
    EXPECT_EQ(backward.at("down"), (std::map<std::string, int64_t>{{"all_gather", 1}})) << comm.tracing_table();
    EXPECT_EQ(backward.count("norm"), 0u) << comm.tracing_table();

    // loss_parallel: vocabulary-sharded logits, three all-reduces (max, sum
    // of exponentials, target logit) in forward, none in backward.
    const at::Tensor logits = distribute_tensor(data({4, 10}), mesh, {Shard(1)}).detach().requires_grad_();
    const at::Tensor target = at::tensor({1, 7, 3, 9}, at::kLong);
    CommDebugMode loss;
    {
      LossParallelGuard guard;
      torch::nn::functional::cross_entropy(logits, target).backward();
    }
    EXPECT_EQ(loss.count(CollectiveType::AllReduce), 3) << loss.tracing_table();
    int64_t forward = 0;
    for (const CommRecord& r : loss.records()) forward += r.pass == Pass::Forward ? r.count : 0;
    EXPECT_EQ(forward, 3) << loss.tracing_table();
  });
}

TEST(CommDebug, LlamaPlanPerBlockForwardAndBackward) {
  run_ranks(2, [](int) {
    const auto mesh = init_device_mesh("cpu", {2}, {"tp"});
    models::LlamaConfig c = dtp::test::small_llama_config(2);
    c.dtype = at::kDouble;
    models::Llama model(c);
    models::TensorParallelOptions o;
    o.sequence_parallel = false;
    models::apply_tensor_parallel(model, mesh, o);
    const at::Tensor batch = dtp::test::llama_batch(c.vocab_size, 0);
    CommDebugMode comm;
    models::llama_loss(model(batch.narrow(1, 0, dtp::test::kSeq)), batch.narrow(1, 1, dtp::test::kSeq)).backward();
    const Counts forward = comm.per_module(Pass::Forward), backward = comm.per_module(Pass::Backward);
    for (int64_t i = 0; i < c.n_layers; ++i) {
      const std::string l = "layers." + std::to_string(i) + ".";
      SCOPED_TRACE(l);
      // Megatron without SP: the attention's and the MLP's output
      // all-reduced in forward (wo, w2: Rowwise), their input gradients in
      // backward (PrepareModuleInput's boundary on attention and
      // feed_forward).
      EXPECT_EQ(forward.at(l + "attention.wo"), (std::map<std::string, int64_t>{{"all_reduce", 1}}));
      EXPECT_EQ(forward.at(l + "feed_forward.w2"), (std::map<std::string, int64_t>{{"all_reduce", 1}}));
      EXPECT_EQ(backward.at(l + "attention"), (std::map<std::string, int64_t>{{"all_reduce", 1}}));
      EXPECT_EQ(backward.at(l + "feed_forward"), (std::map<std::string, int64_t>{{"all_reduce", 1}}));
    }
  });
}

}  // namespace
