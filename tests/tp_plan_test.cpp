// parallelize_module's plan handling, ported from PyTorch's
// test_parallelize_api, plus the errors PyTorch does not raise (an unmatched
// pattern is silently skipped there).
#include "dist.h"

#include "dtp/dtensor.h"
#include "dtp/module_utils.h"
#include "dtp/nn/modules.h"
#include "dtp/tp/parallelize.h"

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

using namespace dtp;
using dtp::test::run_ranks;

namespace {

struct BlockImpl : torch::nn::Module {
  dtp::nn::Linear w1{register_module("w1", dtp::nn::Linear(4, 8))};
  dtp::nn::Linear w2{register_module("w2", dtp::nn::Linear(8, 4))};
  dtp::nn::LayerNorm norm{register_module("norm", dtp::nn::LayerNorm(torch::nn::LayerNormOptions({4})))};
  torch::nn::Linear plain{register_module("plain", torch::nn::Linear(4, 4))};  // no hooks
  at::Tensor forward(const at::Tensor& x) { return w2(w1(x)); }
};
DTP_MODULE(Block);

struct NetImpl : torch::nn::Module {
  torch::nn::ModuleList layers{register_module("layers", torch::nn::ModuleList(Block(), Block()))};
};
DTP_MODULE(Net);


TEST(TpPlanTest, WildcardsMatchPerAtomAndEveryInvalidPlanIsNamed) {
  run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {4}, {"tp"});
    auto mesh2d = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    Net net;
    parallelize_module(*net, mesh, {{"layers.*.w1", ColwiseParallel()}, {"layers.*.w2", RowwiseParallel()}});
    for (int i = 0; i < 2; ++i) {
      auto& b = net->layers->at<BlockImpl>(i);
      EXPECT_EQ(placements(b.w1->weight), Placements{Shard(0)});
      EXPECT_EQ(placements(b.w2->weight), Placements{Shard(1)});
      EXPECT_FALSE(is_dtensor(b.norm->weight));  // untouched
    }
    // Unmatched pattern: an error listing the submodules (PyTorch skips it).
    Net other;
    dtp::test::expect_error([&] { parallelize_module(*other, mesh, {{"layers.*.wq", ColwiseParallel()}}); },
                {"'layers.*.wq'", "matches no submodule", "layers.0.w1"});
    EXPECT_FALSE(is_dtensor(other->layers->at<BlockImpl>(0).w1->weight));  // checked before changing
    // A 2-D mesh: slice it.
    dtp::test::expect_error([&] { parallelize_module(*other, mesh2d, {{"layers.0.w1", ColwiseParallel()}}); },
                {"1-D mesh", "mesh[\"tp\"]"});
    parallelize_module(*other, mesh2d["tp"], {{"layers.0.w1", ColwiseParallel()}});
    EXPECT_EQ(device_mesh(other->layers->at<BlockImpl>(0).w1->weight), mesh2d["tp"]);
    // No mesh and no guard; then the guard supplies it.
    dtp::test::expect_error([&] { parallelize_module(*other, {{"layers.1.w1", ColwiseParallel()}}); }, {"DeviceMeshGuard"});
    {
      DeviceMeshGuard guard(mesh);
      parallelize_module(*other, {{"layers.1.w1", ColwiseParallel()}});
    }
    EXPECT_EQ(placements(other->layers->at<BlockImpl>(1).w1->weight), Placements{Shard(0)});
    // Parallelizing a module twice.
    dtp::test::expect_error([&] { parallelize_module(*other, mesh, {{"layers.0.w1", RowwiseParallel()}}); },
                {"layers.0.w1", "already a DTensor"});
    // Wrong module type for the style, and a module that cannot run hooks.
    dtp::test::expect_error([&] { parallelize_module(*other, mesh, {{"layers.0.norm", ColwiseParallel()}}); },
                {"layers.0.norm", "expected nn::Linear or nn::Embedding"});
    dtp::test::expect_error([&] { parallelize_module(*other, mesh, {{"layers.0.plain", ColwiseParallel()}}); },
                {"layers.0.plain", "cannot run hooks", "dtp::nn::Linear"});
    // An empty plan changes nothing.
    Net empty;
    const at::Tensor before = empty->layers->at<BlockImpl>(0).w1->weight.clone();
    parallelize_module(*empty, mesh, ParallelizePlan{});
    EXPECT_FALSE(is_dtensor(empty->layers->at<BlockImpl>(0).w1->weight));
    EXPECT_TRUE(empty->layers->at<BlockImpl>(0).w1->weight.equal(before));
  });
}

// A Rowwise Embedding and a Colwise output Linear sharing one weight both use
// Shard(0): the tie survives, and training updates the one tensor.
TEST(TpPlanTest, TiedEmbeddingAndHeadStayTied) {
  struct TiedImpl : torch::nn::Module {
    dtp::nn::Embedding emb{register_module("emb", dtp::nn::Embedding(10, 4))};
    dtp::nn::Linear head{register_module("head", dtp::nn::Linear(torch::nn::LinearOptions(4, 10).bias(false)))};
  };
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"tp"});
    auto tied = std::make_shared<TiedImpl>();
    set_parameter(*tied->head, "weight", tied->emb->weight);
    parallelize_module(*tied, mesh, {{"emb", RowwiseParallel(RowwiseParallelOptions().input_layouts(Replicate()))},
                                     {"head", ColwiseParallel()}});
    EXPECT_TRUE(tied->head->weight.is_same(tied->emb->weight));
    EXPECT_TRUE(tied->head->named_parameters()["weight"].is_same(tied->emb->named_parameters()["weight"]));
    EXPECT_EQ(placements(tied->emb->weight), Placements{Shard(0)});
  });
}

}  // namespace
