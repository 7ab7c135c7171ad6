// Tensor-parallel styles on single modules, ported from PyTorch's
// test_tp_style.py: outputs, input and parameter gradients against one
// device, and the exact collectives forward and backward.
#include "close.h"
#include "dist.h"
#include "parity.h"

#include "dtp/comm_counter.h"
#include "dtp/nn/modules.h"
#include "dtp/tp/parallelize.h"

using namespace dtp;
using dtp::test::data;
using dtp::test::run_ranks;

namespace {

template <class M>
void setDeterministic(M& m) {
  torch::NoGradGuard g;
  double seed = 0;
  for (auto& p : m->parameters()) p.copy_(data(p.sizes().vec(), seed += 1).to(p.scalar_type()));
}

at::Tensor chunk(const at::Tensor& t, int64_t dim, int w, int r) {
  return t.narrow(dim, chunk_start(t.size(dim), w, r), chunk_size(t.size(dim), w, r));
}

// Gradient shards are contiguous, as AccumulateGrad makes plain gradients (a
// linear weight's arrives as a transposed view): optimizers read them densely.
void expectContiguousGrads(torch::nn::Module& m) {
  for (const auto& p : m.named_parameters()) {
    const at::Tensor local = to_local(p.value().grad());
    EXPECT_TRUE(local.is_contiguous()) << p.key() << " gradient shard has strides " << local.strides();
  }
}

struct Counts {
  int64_t fwd_total, fwd_coll, bwd_total, bwd_coll;
  CollectiveType fwd_type, bwd_type;
};

// Runs `m` on `in` (this rank's input) and the reference on `full_in`,
// checking outputs, gradients and collective counts; twice, the second time
// accumulating into the gradients of the first.
template <class M>
void checkLinear(M& m, M& ref, const at::Tensor& in, const at::Tensor& full_in,
                 const std::function<at::Tensor(const at::Tensor&)>& gather_out,
                 const std::function<at::Tensor(const at::Tensor&)>& gather_in_grad, Counts c) {
  for (int pass = 0; pass < 2; ++pass) {
    SCOPED_TRACE(pass == 0 ? "first backward" : "second backward, accumulating");
    at::Tensor x = in.detach().requires_grad_(true);
    at::Tensor fx = full_in.detach().requires_grad_(true);
    CommCounter fwd;
    at::Tensor y = m(x);
    EXPECT_EQ(fwd.total_count(), c.fwd_total) << fwd.str();
    EXPECT_EQ(fwd.count(c.fwd_type), c.fwd_coll) << fwd.str();
    at::Tensor ry = ref(fx);
    EXPECT_CLOSE(gather_out(y), ry, 1e-5, 1e-5);
    at::Tensor g = data(ry.sizes().vec(), 3.0).to(at::kFloat);
    (gather_out(y) * g).sum().backward();
    (ry * g).sum().backward();
    EXPECT_CLOSE(gather_in_grad(x.grad()), fx.grad(), 1e-5, 1e-5);
    for (const auto& p : ref->named_parameters()) {
      at::Tensor mine = m->named_parameters()[p.key()];
      ASSERT_TRUE(mine.grad().defined()) << p.key();
      EXPECT_EQ(placements(mine.grad()), placements(mine)) << p.key();
      EXPECT_CLOSE(full_tensor(mine.grad()), p.value().grad(), 1e-5, 1e-5) << p.key();
    }
    expectContiguousGrads(*m);
  }
}

TEST(TpStyleTest, ColwiseLinearNoForwardCommOneBackwardAllReduce) {
  for (int w : {2, 4}) {
    run_ranks(w, [&](int) {
      auto mesh = init_device_mesh("cpu", {w});
      for (int64_t out : {4 * w, 4 * w + 1}) {  // even and uneven output features
        dtp::nn::Linear m(6, out), ref(6, out);
        setDeterministic(m);
        setDeterministic(ref);
        parallelize_module(*m, mesh, ColwiseParallel());
        at::Tensor x = data({5, 6}).to(at::kFloat).detach().requires_grad_(true);
        CommCounter fwd;
        at::Tensor y = m(x);  // local shard of the last dim (use_local_output)
        EXPECT_EQ(fwd.total_count(), 0) << fwd.str();
        EXPECT_FALSE(is_dtensor(y));
        at::Tensor ry = ref(x.detach());
        EXPECT_CLOSE(y, chunk(ry, 1, w, mesh.get_local_rank()), 1e-5, 1e-5);
        CommCounter bwd;
        y.sum().backward();
        // The replicated input's gradient is Partial: one all_reduce.
        EXPECT_EQ(bwd.count(CollectiveType::AllReduce), 1) << bwd.str();
        EXPECT_EQ(bwd.total_count(), 1) << bwd.str();
        at::Tensor rx = data({5, 6}).to(at::kFloat).requires_grad_(true);
        ref(rx).sum().backward();
        EXPECT_CLOSE(x.grad(), rx.grad(), 1e-5, 1e-5);
        EXPECT_CLOSE(full_tensor(m->weight.grad()), ref->weight.grad(), 1e-5, 1e-5);
        EXPECT_CLOSE(full_tensor(m->bias.grad()), ref->bias.grad(), 1e-5, 1e-5);
        expectContiguousGrads(*m);
      }
    });
  }
}

TEST(TpStyleTest, RowwiseLinearOneForwardAllReduceNoBackwardComm) {
  for (int w : {2, 4}) {
    run_ranks(w, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {w});
      for (int64_t in : {4 * w, 4 * w + 3}) {
        dtp::nn::Linear m(in, 5), ref(in, 5);
        setDeterministic(m);
        setDeterministic(ref);
        parallelize_module(*m, mesh, RowwiseParallel());
        at::Tensor full = data({3, in}).to(at::kFloat);
        at::Tensor x = chunk(full, 1, w, rank).clone().requires_grad_(true);
        CommCounter fwd;
        at::Tensor y = m(x);
        EXPECT_EQ(fwd.count(CollectiveType::AllReduce), 1) << fwd.str();
        EXPECT_EQ(fwd.total_count(), 1) << fwd.str();
        at::Tensor rx = full.clone().requires_grad_(true);
        at::Tensor ry = ref(rx);
        EXPECT_CLOSE(y, ry, 1e-5, 1e-5);
        at::Tensor g = data(ry.sizes().vec(), 2.0).to(at::kFloat);
        CommCounter bwd;
        (y * g).sum().backward();
        EXPECT_EQ(bwd.total_count(), 0) << bwd.str();
        (ry * g).sum().backward();
        EXPECT_CLOSE(x.grad(), chunk(rx.grad(), 1, w, rank), 1e-5, 1e-5);
        EXPECT_CLOSE(full_tensor(m->weight.grad()), ref->weight.grad(), 1e-5, 1e-5);
        EXPECT_CLOSE(full_tensor(m->bias.grad()), ref->bias.grad(), 1e-5, 1e-5);
        expectContiguousGrads(*m);
      }
    });
  }
}

TEST(TpStyleTest, RowwiseLinearToShardOneReduceScatter) {
  run_ranks(2, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    dtp::nn::Linear m(8, 6), ref(8, 6);
    setDeterministic(m);
    setDeterministic(ref);
    parallelize_module(*m, mesh, RowwiseParallel(RowwiseParallelOptions().output_layouts(Shard(0))));
    at::Tensor full = data({5, 8}).to(at::kFloat);
    CommCounter fwd;
    at::Tensor y = m(chunk(full, 1, 2, rank));
    EXPECT_EQ(fwd.count(CollectiveType::ReduceScatter), 1) << fwd.str();
    EXPECT_EQ(fwd.total_count(), 1);
    EXPECT_CLOSE(y, chunk(ref(full), 0, 2, rank), 1e-5, 1e-5);
  });
}

TEST(TpStyleTest, EmbeddingColwiseAndRowwise) {
  for (int w : {2, 4}) {
    run_ranks(w, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {w});
      at::Tensor ids = at::remainder(at::arange(12, at::kLong) * 5, 4 * w + 1).view({3, 4});
      {
        dtp::nn::Embedding m(4 * w + 1, 2 * w), ref(4 * w + 1, 2 * w);
        setDeterministic(m);
        setDeterministic(ref);
        parallelize_module(*m, mesh, ColwiseParallel());
        CommCounter fwd;
        at::Tensor y = m(ids);
        EXPECT_EQ(fwd.total_count(), 0);
        ASSERT_EQ(y.sizes(), chunk(ref(ids), 2, w, rank).sizes());
        EXPECT_CLOSE(y, chunk(ref(ids), 2, w, rank), 1e-5, 1e-8);
      }
      {
        dtp::nn::Embedding m(4 * w + 1, 6), ref(4 * w + 1, 6);  // uneven vocab
        setDeterministic(m);
        setDeterministic(ref);
        // As in PyTorch's test_tp_style: Rowwise's default input layout is Shard(-1), so the ids are
        // declared replicated.
        parallelize_module(*m, mesh, RowwiseParallel(RowwiseParallelOptions().input_layouts(Replicate())));
        CommCounter fwd;
        at::Tensor y = m(ids);
        EXPECT_EQ(fwd.count(CollectiveType::AllReduce), 1) << fwd.str();
        EXPECT_EQ(fwd.total_count(), 1) << fwd.str();
        EXPECT_CLOSE(y, ref(ids), 1e-5, 1e-8);
        y.pow(2).sum().backward();
        ref(ids).pow(2).sum().backward();
        EXPECT_EQ(placements(m->weight.grad()), Placements{Shard(0)});
        EXPECT_CLOSE(full_tensor(m->weight.grad()), ref->weight.grad(), 1e-5, 1e-5);
      }
    });
  }
}

// The vocab-sharded weight's gradient is computed for this rank's rows only
// (NOTE: [Vocab-sharded embedding backward]), padding_idx and
// scale_grad_by_freq included, with an uneven vocabulary.
TEST(TpStyleTest, RowwiseEmbeddingBackwardComputesLocalRows) {
  for (int w : {2, 4}) {
    run_ranks(w, [&](int) {
      auto mesh = init_device_mesh("cpu", {w});
      const int64_t vocab = 4 * w + 1;
      at::Tensor ids = at::remainder(at::arange(12, at::kLong) * 5, vocab).view({3, 4});
      auto opts = torch::nn::EmbeddingOptions(vocab, 6).padding_idx(5).scale_grad_by_freq(true);
      dtp::nn::Embedding m(opts), ref(opts);
      setDeterministic(m);
      setDeterministic(ref);
      parallelize_module(*m, mesh, RowwiseParallel(RowwiseParallelOptions().input_layouts(Replicate())));
      at::Tensor g = data({3, 4, 6}, 0.7).to(at::kFloat);
      (m(ids) * g).sum().backward();
      (ref(ids) * g).sum().backward();
      EXPECT_EQ(placements(m->weight.grad()), Placements{Shard(0)});
      EXPECT_CLOSE(full_tensor(m->weight.grad()), ref->weight.grad(), 1e-5, 1e-5);

      // The op itself: a MaskPartial gradient (as the backward of the
      // lookup's reduction makes it: NOTE: [MaskPartial]) and the indices
      // give the weight's rows directly, Shard(0), without communication.
      at::Tensor weight = distribute_tensor(ref->weight.detach(), mesh, {Shard(0)});
      at::Tensor dids = distribute_tensor(ids, mesh, {Replicate()});
      at::Tensor out = at::embedding(weight, dids);
      EXPECT_EQ(placements(out), Placements{MaskPartial(vocab)});
      at::Tensor dg;
      {
        at::Tensor y = at::embedding(weight.detach().requires_grad_(true), dids);
        y.register_hook([&](const at::Tensor& gy) { dg = gy; });
        (redistribute(y, mesh, {Replicate()}) * distribute_tensor(g, mesh, {Replicate()})).sum().backward();
      }
      EXPECT_EQ(placements(dg), Placements{MaskPartial(vocab)});
      CommCounter comm;
      at::Tensor dw = at::embedding_dense_backward(dg, dids, vocab, 5, true);
      EXPECT_EQ(comm.total_count(), 0) << comm.str();
      EXPECT_EQ(placements(dw), Placements{Shard(0)});
      EXPECT_CLOSE(full_tensor(dw), at::embedding_dense_backward(g, ids, vocab, 5, true), 1e-6, 1e-6);
    });
  }
}

TEST(TpStyleTest, SequenceParallelLayerNormAndRMSNorm) {
  run_ranks(2, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    dtp::nn::LayerNorm ln(torch::nn::LayerNormOptions({6})), ref_ln(torch::nn::LayerNormOptions({6}));
    dtp::nn::RMSNorm rms(6), ref_rms(6);
    setDeterministic(ln);
    setDeterministic(ref_ln);
    setDeterministic(rms);
    setDeterministic(ref_rms);
    parallelize_module(*ln, mesh, SequenceParallel());
    parallelize_module(*rms, mesh, SequenceParallel());
    at::Tensor full = data({2, 8, 6}).to(at::kFloat);
    CommCounter fwd;
    at::Tensor y = rms(ln(chunk(full, 1, 2, rank)));
    EXPECT_EQ(fwd.total_count(), 0) << fwd.str();
    EXPECT_EQ(placements(y), Placements{Shard(1)});
    at::Tensor ry = ref_rms(ref_ln(full));
    EXPECT_CLOSE(full_tensor(y), ry, 1e-5, 1e-5);
    CommCounter bwd;
    to_local(y).sum().backward();
    // The three replicated weights' Partial gradients share one all-reduce.
    EXPECT_EQ(bwd.count(CollectiveType::AllReduce), 1) << bwd.str();
    EXPECT_EQ(bwd.bytes(CollectiveType::AllReduce), 3 * 6 * 4) << bwd.str();
    ry.sum().backward();
    EXPECT_CLOSE(full_tensor(ln->weight.grad()), ref_ln->weight.grad(), 1e-5, 1e-5);
    EXPECT_CLOSE(full_tensor(rms->weight.grad()), ref_rms->weight.grad(), 1e-5, 1e-5);
  });
}

TEST(TpStyleTest, PrepareModuleInputAndOutput) {
  run_ranks(2, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    dtp::nn::Linear m(4, 4);
    setDeterministic(m);
    at::Tensor w = m->weight.detach().clone(), b = m->bias.detach().clone();
    parallelize_module(*m, mesh, PrepareModuleInputOutput(
        PrepareModuleInputOptions().input_layouts({Shard(0)}).desired_input_layouts({Replicate()}),
        PrepareModuleOutputOptions().output_layouts(Replicate()).desired_output_layouts(Shard(0))));
    // Parameters stay plain: the plain weights meet a Replicate DTensor input
    // only under implicit replication.
    at::Tensor full = data({6, 4}).to(at::kFloat);
    ImplicitReplicationGuard implicit;
    CommCounter fwd;
    at::Tensor y = m(chunk(full, 0, 2, rank));
    EXPECT_EQ(fwd.count(CollectiveType::AllGather), 1) << fwd.str();
    EXPECT_FALSE(is_dtensor(y));
    EXPECT_CLOSE(y, chunk(at::linear(full, w, b), 0, 2, rank), 1e-5, 1e-5);
  });
}

struct TwoProjectionsImpl : torch::nn::Module {
  dtp::nn::Linear a{register_module("a", dtp::nn::Linear(4, 6))};
  dtp::nn::Linear b{register_module("b", dtp::nn::Linear(4, 6))};
  at::Tensor forward(const at::Tensor& x) { return a(x) + b(x); }
};
DTP_MODULE(TwoProjections);

// Megatron's f: with gradient_boundary, the Partial gradients of the two
// Colwise projections meet at the module's input and leave it Replicate
// (one all-reduce there); without, the layer before gets them Partial.
TEST(TpStyleTest, PrepareModuleInputGradientBoundary) {
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    for (bool boundary : {true, false}) {
      SCOPED_TRACE(boundary ? "boundary" : "no boundary");
      TwoProjections m;
      setDeterministic(m);
      TwoProjections ref;
      setDeterministic(ref);
      parallelize_module(*m, mesh, {{"a", ColwiseParallel(ColwiseParallelOptions().use_local_output(false))},
                                    {"b", ColwiseParallel(ColwiseParallelOptions().use_local_output(false))}});
      parallelize_module(*m, mesh, PrepareModuleInput(PrepareModuleInputOptions()
                                                          .input_layouts({Replicate()})
                                                          .desired_input_layouts({Replicate()})
                                                          .gradient_boundary(boundary)));
      const at::Tensor full = data({3, 4}).to(at::kFloat);
      at::Tensor leaf = distribute_tensor(full.clone().requires_grad_(true), mesh, {Replicate()});
      at::Tensor h = leaf * 2;  // the layer before the module
      Placements seen;
      h.register_hook([&](const at::Tensor& g) { seen = placements(g); });
      at::Tensor y = m(h);
      CommCounter bwd;
      full_tensor(y).sum().backward();
      EXPECT_EQ(seen, boundary ? Placements{Replicate()} : Placements{Partial()});
      EXPECT_EQ(bwd.count(CollectiveType::AllReduce), 1) << bwd.str();  // at the boundary, or for the leaf
      at::Tensor fx = full.clone().requires_grad_(true);
      ref(fx * 2).sum().backward();
      EXPECT_CLOSE(full_tensor(leaf.grad()), fx.grad(), 1e-5, 1e-5);
    }
  });
}

}  // namespace
