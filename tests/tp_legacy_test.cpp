// The 2023 API (PairwiseParallel, make_input_*/make_output_*) against one
// device, as in PyTorch's older test_tp_examples / test_parallelize_api.
#include "close.h"
#include "dist.h"
#include "parity.h"

#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/nn/modules.h"
#include "dtp/nn/multihead_attention.h"
#include "dtp/tp/legacy.h"
#include "dtp/tp/parallelize.h"
#include "dtp/random.h"

using namespace dtp;
using dtp::test::data;
using dtp::test::run_ranks;

namespace {

struct MlpImpl : torch::nn::Module {
  dtp::nn::Linear fc1{register_module("fc1", dtp::nn::Linear(6, 8))};
  dtp::nn::Linear fc2{register_module("fc2", dtp::nn::Linear(8, 6))};
  at::Tensor forward(const at::Tensor& x) { return fc2(at::relu(fc1(x))); }
};
DTP_MODULE(Mlp);

TEST(TpLegacyTest, PairwiseParallelIsColwiseThenRowwise) {
  for (int w : {2, 4}) {
    run_ranks(w, [&](int) {
      auto mesh = init_device_mesh("cpu", {w});
      Mlp m, ref;
      {
        torch::NoGradGuard g;
        for (auto& p : m->named_parameters()) {
          p.value().copy_(data(p.value().sizes().vec(), p.key().size()).to(at::kFloat));
          ref->named_parameters()[p.key()].copy_(p.value());
        }
      }
      parallelize_module(*m, mesh, PairwiseParallel());
      EXPECT_EQ(placements(m->fc1->weight), Placements{Shard(0)});
      EXPECT_EQ(placements(m->fc2->weight), Placements{Shard(1)});
      at::Tensor x = data({5, 6}).to(at::kFloat);
      CommCounter fwd;
      at::Tensor y = m(x);
      EXPECT_EQ(fwd.count(CollectiveType::AllReduce), 1) << fwd.str();
      EXPECT_EQ(fwd.total_count(), 1) << fwd.str();
      at::Tensor ry = ref(x);
      EXPECT_CLOSE(y, ry, 1e-5, 1e-5);
      y.sum().backward();
      ry.sum().backward();
      for (const auto& p : ref->named_parameters())
        EXPECT_CLOSE(full_tensor(m->named_parameters()[p.key()].grad()), p.value().grad(), 1e-5, 1e-5)
            << p.key();
    });
  }
}

TEST(TpLegacyTest, PairwiseParallelNeedsTwoLinears) {
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    dtp::nn::Linear lin(4, 4);
    dtp::test::expect_error([&] { parallelize_module(*lin, mesh, PairwiseParallel()); },
                            {"PairwiseParallel", "holds no MLP", "at any depth"});
  });
}

// PyTorch 2.0 looked for MLPs (two or more Linear children) and attention at
// any depth: a model of blocks, each holding an MLP of three Linears (the
// third, odd one, stays replicated) next to a stock-free attention.
struct DeepMlpImpl : torch::nn::Module {
  dtp::nn::Linear a{register_module("a", dtp::nn::Linear(6, 8))};
  dtp::nn::Linear b{register_module("b", dtp::nn::Linear(8, 6))};
  dtp::nn::Linear c{register_module("c", dtp::nn::Linear(6, 6))};
  at::Tensor forward(const at::Tensor& x) { return c(b(at::relu(a(x)))); }
};
DTP_MODULE(DeepMlp);
struct BlockImpl : torch::nn::Module {
  DeepMlp mlp{register_module("mlp", DeepMlp())};
  at::Tensor forward(const at::Tensor& x) { return x + mlp(x); }
};
DTP_MODULE(Block);
struct StackImpl : torch::nn::Module {
  Block first{register_module("first", Block())};
  Block second{register_module("second", Block())};
  at::Tensor forward(const at::Tensor& x) { return second(first(x)); }
};
DTP_MODULE(Stack);

template <class M>
void copyParams(M& from, M& to) {
  torch::NoGradGuard g;
  double seed = 0;
  for (auto& p : from->named_parameters()) {
    p.value().copy_(data(p.value().sizes().vec(), seed += 1).to(p.value().scalar_type()));
    to->named_parameters()[p.key()].copy_(p.value());
  }
}

TEST(TpLegacyTest, PairwiseParallelFindsPairsAtAnyDepth) {
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    Stack m, ref;
    m->to(at::kDouble);
    ref->to(at::kDouble);
    copyParams(m, ref);
    parallelize_module(*m, mesh, PairwiseParallel());
    for (const char* block : {"first", "second"}) {
      const std::string pre = std::string(block) + ".mlp.";
      EXPECT_EQ(placements(m->named_parameters()[pre + "a.weight"]), Placements{Shard(0)}) << block;
      EXPECT_EQ(placements(m->named_parameters()[pre + "b.weight"]), Placements{Shard(1)}) << block;
      EXPECT_FALSE(is_dtensor(m->named_parameters()[pre + "c.weight"])) << block;
    }
    const at::Tensor x = data({5, 6});
    CommCounter fwd;
    at::Tensor y = m(x);
    EXPECT_EQ(fwd.count(CollectiveType::AllReduce), 2) << fwd.str();  // one per MLP
    EXPECT_EQ(fwd.total_count(), 2) << fwd.str();
    EXPECT_CLOSE(y, ref(x), 1e-12, 1e-12);
  });
}

// PyTorch 2.0's SequenceParallel: PairwiseParallel with the input and the
// output sharded on dim 0 (the sequence): an all-gather in, a
// reduce-scatter out, and the reverse in backward.
TEST(TpLegacyTest, LegacySequenceParallelShardsTheSequenceAroundPairs) {
  for (int w : {2, 3}) {
    run_ranks(w, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {w});
      Mlp m, ref;
      m->to(at::kDouble);
      ref->to(at::kDouble);
      copyParams(m, ref);
      parallelize_module(*m, mesh, legacy::SequenceParallel());
      const at::Tensor x = data({3 * w, 6});
      const auto start = chunk_start(3 * w, w, rank), size = chunk_size(3 * w, w, rank);
      at::Tensor lx = x.narrow(0, start, size).clone().requires_grad_(true);
      CommCounter fwd;
      at::Tensor y = m(lx);
      EXPECT_EQ(fwd.count(CollectiveType::AllGather), 1) << fwd.str();
      EXPECT_EQ(fwd.count(CollectiveType::ReduceScatter), 1) << fwd.str();
      EXPECT_EQ(fwd.total_count(), 2) << fwd.str();
      EXPECT_FALSE(is_dtensor(y));
      at::Tensor fx = x.clone().requires_grad_(true);
      at::Tensor ry = ref(fx);
      EXPECT_CLOSE(y, ry.narrow(0, start, size), 1e-12, 1e-12);
      CommCounter bwd;
      y.sum().backward();
      EXPECT_EQ(bwd.count(CollectiveType::AllGather), 1) << bwd.str();
      EXPECT_EQ(bwd.count(CollectiveType::ReduceScatter), 1) << bwd.str();
      ry.sum().backward();
      EXPECT_CLOSE(lx.grad(), fx.grad().narrow(0, start, size), 1e-12, 1e-12);
      for (const auto& p : ref->named_parameters())
        EXPECT_CLOSE(full_tensor(m->named_parameters()[p.key()].grad()), p.value().grad(), 1e-12, 1e-12) << p.key();
    });
  }
}

struct StockAttentionImpl : torch::nn::Module {
  torch::nn::MultiheadAttention attn{register_module("attn", torch::nn::MultiheadAttention(8, 4))};
};
TORCH_MODULE(StockAttention);

// A stock MultiheadAttention field cannot be swapped (its parent calls the
// stock forward): the error gives the exact declaration to write instead.
TEST(TpLegacyTest, StockMultiheadAttentionFieldIsRefusedWithTheChange) {
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    StockAttention m;
    dtp::test::expect_error([&] { parallelize_module(*m, mesh, PairwiseParallel()); },
                            {"the module at 'attn' is a stock torch::nn::MultiheadAttention",
                             "`dtp::nn::MultiheadAttention attn{nullptr};`"});
    EXPECT_FALSE(is_dtensor(m->attn->in_proj_weight));
  });
}

TEST(TpLegacyTest, MakeInputAndOutputHelpers) {
  run_ranks(2, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    at::Tensor full = data({4, 6});
    at::Tensor rows = full.chunk(2, 0)[rank], cols = full.chunk(2, 1)[rank];
    EXPECT_TRUE(full_tensor(make_input_shard_1d(rows, mesh)).equal(full));
    EXPECT_TRUE(full_tensor(make_input_shard_1d_last_dim(cols, mesh)).equal(full));
    EXPECT_EQ(placements(make_input_replicate_1d(full, mesh)), Placements{Replicate()});
    at::Tensor r = make_input_reshard_replicate(rows, mesh);
    EXPECT_EQ(placements(r), Placements{Replicate()});
    EXPECT_TRUE(to_local(r).equal(full));
    at::Tensor s = distribute_tensor(full, mesh, {Shard(1)});
    EXPECT_TRUE(make_output_tensor(s, mesh).equal(full));
    EXPECT_TRUE(make_output_reshard_tensor(s, mesh).equal(rows));
    EXPECT_EQ(placements(make_output_shard_1d(s, mesh, 0)), Placements{Shard(0)});
    EXPECT_EQ(placements(make_output_replicate_1d(s, mesh)), Placements{Replicate()});
    dtp::test::expect_error([&] { make_output_tensor(full, mesh); }, {"make_output_tensor", "plain tensor"});
  });
}

}  // namespace

// PairwiseParallel on MultiheadAttention splits heads: outputs, attention
// weights, input and parameter gradients equal the stock module on one
// device, dropout included; 1 all-reduce forward (+1 for averaged weights,
// or 1 all-gather for per-head ones) and 1 backward per distinct input.
struct MhaCase {
  bool bias, separate_kv, masks, need_weights, average;
  double dropout;
};

TEST(TpLegacyTest, PairwiseParallelSplitsMultiheadAttentionHeads) {
  const int64_t e = 8, heads = 4, len = 5, batch = 3, kv_dim = 6;
  for (int w : {2, 4}) {
    for (MhaCase c : {MhaCase{true, false, false, false, true, 0.0}, MhaCase{true, false, true, true, true, 0.0},
                      MhaCase{false, true, true, true, false, 0.0}, MhaCase{true, false, true, true, true, 0.3}}) {
      SCOPED_TRACE("ranks=" + std::to_string(w) + " bias=" + std::to_string(c.bias) + " kdim=" +
                   std::to_string(c.separate_kv) + " masks=" + std::to_string(c.masks) + " weights=" +
                   std::to_string(c.need_weights) + " avg=" + std::to_string(c.average) +
                   " dropout=" + std::to_string(c.dropout));
      auto opts = torch::nn::MultiheadAttentionOptions(e, heads).bias(c.bias).dropout(c.dropout);
      if (c.separate_kv) opts.kdim(kv_dim).vdim(kv_dim);
      torch::nn::MultiheadAttention ref(opts);
      {
        torch::NoGradGuard g;
        for (auto& p : ref->named_parameters())
          p.value().copy_(data(p.value().sizes().vec(), p.key().size()).to(at::kFloat) * 0.5);
      }
      const at::Tensor x = data({len, batch, e}).to(at::kFloat);
      const at::Tensor kv = data({len, batch, kv_dim}, 1.0).to(at::kFloat);
      at::Tensor attn_mask, pad_mask;
      if (c.masks) {
        attn_mask = at::full({len, len}, -INFINITY).triu(1);
        pad_mask = at::zeros({batch, len}, at::kBool);
        pad_mask[1][len - 1] = true;
      }
      auto run = [&](auto& module, const at::Tensor& xin, const at::Tensor& kvin) {
        const at::Tensor& k = c.separate_kv ? kvin : xin;
        return module->forward(xin, k, k, pad_mask, c.need_weights, attn_mask, c.average);
      };
      auto lossOf = [&](const std::tuple<at::Tensor, at::Tensor>& r) {
        at::Tensor loss = (std::get<0>(r) * data(std::get<0>(r).sizes().vec(), 2.0).to(at::kFloat)).sum();
        if (c.need_weights) loss = loss + (std::get<1>(r) * data(std::get<1>(r).sizes().vec(), 3.0).to(at::kFloat)).sum();
        return loss;
      };
      const at::Tensor rx = x.clone().requires_grad_(), rkv = kv.clone().requires_grad_();
      at::manual_seed(5);
      const auto want = run(ref, rx, rkv);
      lossOf(want).backward();

      run_ranks(w, [&](int) {
        auto mesh = init_device_mesh("cpu", {w});
        dtp::nn::MultiheadAttention m(opts);
        {
          torch::NoGradGuard g;
          for (auto& p : m->named_parameters()) p.value().copy_(ref->named_parameters()[p.key()]);
        }
        parallelize_module(*m, mesh, PairwiseParallel());
        EXPECT_EQ(placements(m->out_proj->weight), Placements{Shard(1)});
        const at::Tensor tx = x.clone().requires_grad_(), tkv = kv.clone().requires_grad_();
        dtp::manual_seed(5);
        CommCounter fwd;
        const auto got = run(m, tx, tkv);
        const int64_t weight_ar = c.need_weights && c.average, weight_ag = c.need_weights && !c.average;
        EXPECT_EQ(fwd.count(CollectiveType::AllReduce), 1 + weight_ar) << fwd.str();
        EXPECT_EQ(fwd.count(CollectiveType::AllGather), weight_ag) << fwd.str();
        // With dropout, the first random op after manual_seed syncs the
        // generators: one broadcast (NOTE: [Generator sync]).
        const int64_t sync = c.dropout > 0 ? 1 : 0;
        EXPECT_EQ(fwd.count(CollectiveType::Broadcast), sync) << fwd.str();
        EXPECT_EQ(fwd.total_count(), 1 + weight_ar + weight_ag + sync) << fwd.str();
        EXPECT_FALSE(is_dtensor(std::get<0>(got)));
        EXPECT_CLOSE(std::get<0>(got), std::get<0>(want), 1e-5, 1e-5);
        if (c.need_weights) EXPECT_CLOSE(std::get<1>(got), std::get<1>(want), 1e-5, 1e-5);
        else EXPECT_FALSE(std::get<1>(got).defined());
        CommCounter bwd;
        lossOf(got).backward();
        EXPECT_EQ(bwd.count(CollectiveType::AllReduce), c.separate_kv ? 2 : 1) << bwd.str();
        EXPECT_EQ(bwd.total_count(), c.separate_kv ? 2 : 1) << bwd.str();
        EXPECT_CLOSE(tx.grad(), rx.grad(), 1e-5, 1e-5);
        if (c.separate_kv) EXPECT_CLOSE(tkv.grad(), rkv.grad(), 1e-5, 1e-5);
        for (const auto& p : ref->named_parameters()) {
          const at::Tensor grad = full_tensor(m->named_parameters()[p.key()].grad()).reshape(p.value().sizes());
          EXPECT_CLOSE(grad, p.value().grad(), 1e-5, 1e-5) << p.key();
        }
        if (!c.separate_kv) EXPECT_TRUE(full_tensor(m->in_proj_weight).flatten(0, 1).equal(ref->in_proj_weight));
      });
    }
  }
}

TEST(TpLegacyTest, MultiheadAttentionErrorsNameTheModuleAndFix) {
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    dtp::nn::MultiheadAttention odd(6, 3);
    dtp::test::expect_error([&] { parallelize_module(*odd, mesh, PairwiseParallel()); },
                            {"num_heads", "got 3 heads for 2 ranks", "divisible"});
    torch::nn::MultiheadAttention stock(8, 4);
    dtp::test::expect_error([&] { parallelize_module(*stock, mesh, PairwiseParallel()); },
                            {"torch::nn::MultiheadAttention", "dtp::nn::MultiheadAttention"});
    dtp::nn::MultiheadAttention bias_kv(torch::nn::MultiheadAttentionOptions(8, 4).add_bias_kv(true));
    dtp::test::expect_error([&] { parallelize_module(*bias_kv, mesh, PairwiseParallel()); },
                            {"NYI", "add_bias_kv"});
    dtp::nn::MultiheadAttention m(8, 4);
    parallelize_module(*m, mesh, PairwiseParallel());
    dtp::test::expect_error([&] { parallelize_module(*m, mesh, PairwiseParallel()); }, {"split already"});
    const at::Tensor x = at::randn({3, 2, 8});
    dtp::test::expect_error([&] { m->forward(x, x, x, {}, false, at::ones({3, 3}, at::kBool)); },
                            {"NYI", "attn_mask", "float [L, S] mask"});
  });
}
