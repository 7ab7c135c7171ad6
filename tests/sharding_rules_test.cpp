// Golden tests of the sharding rules, family by family, without
// communication (rule_golden.h): what each rule decides for given input
// specs on 1-D meshes of 2 and 4 ranks and a (2,2) mesh, uneven shapes
// included. "A, B -> out": the placements inputs are moved to, then the
// outputs' specs.
#include "dist.h"
#include "rule_golden.h"

#include "dtp/comm_counter.h"
#include "dtp/random.h"

#include "dtp/dtensor.h"

#include <gtest/gtest.h>

using dtp::test::RuleGolden;
using IntList = std::vector<int64_t>;

namespace {

// Linearity decides where a Partial may pass: add keeps P+P, mul one P, div
// a P numerator, masked_fill only with 0; anything else reduces first
// (reduce-scatter is the cheapest way out of a Partial).
TEST(ShardingRuleTest, Pointwise) {
  RuleGolden g({2}), g4({4});
  EXPECT_EQ(g.propagate("aten::add.Tensor", {g.t("f32[8,16](S(0))"), g.t("f32[8,16](S(0))")}),
            "S(0), S(0) -> f32[8,16](S(0))");
  EXPECT_EQ(g.propagate("aten::add.Tensor", {g.t("f32[8,16](P(sum))"), g.t("f32[8,16](P(sum))")}),
            "P(sum), P(sum) -> f32[8,16](P(sum))");
  EXPECT_EQ(g.propagate("aten::add.Tensor", {g.t("f32[8,16](S(1))"), g.t("f32[16](R)")}),
            "S(1), S(0) -> f32[8,16](S(1))");
  EXPECT_EQ(g.propagate("aten::mul.Tensor", {g.t("f32[8,16](P(sum))"), g.t("f32[8,16](R)")}),
            "P(sum), R -> f32[8,16](P(sum))");
  EXPECT_EQ(g.propagate("aten::mul.Tensor", {g.t("f32[8,16](P(sum))"), g.t("f32[8,16](P(sum))")}),
            "S(0), S(0) -> f32[8,16](S(0))");
  EXPECT_EQ(g.propagate("aten::exp", {g.t("f32[8,16](P(sum))")}),
            "S(0) -> f32[8,16](S(0))");
  EXPECT_EQ(g.propagate("aten::div.Tensor", {g.t("f32[8,16](P(avg))"), g.t("f32[8,16](R)")}),
            "P(avg), R -> f32[8,16](P(avg))");
  EXPECT_EQ(g.propagate("aten::masked_fill.Scalar", {g.t("f32[5](P(sum))"), g.t("b8[5](R)"), 0.0}),
            "P(sum), R -> f32[5](P(sum))");
  EXPECT_EQ(g.propagate("aten::masked_fill.Scalar", {g.t("f32[5](P(sum))"), g.t("b8[5](R)"), 1.0}),
            "S(0), S(0) -> f32[5](S(0))");
  EXPECT_EQ(g4.propagate("aten::add.Tensor", {g4.t("f32[5,3](S(0))"), g4.t("f32[5,3](R)")}),
            "S(0), S(0) -> f32[5,3](S(0))");
  EXPECT_EQ(g.propagate("aten::add_.Tensor", {g.t("f32[8,16](R)"), g.t("f32[8,16](S(0))")}),
            "R, R -> self");
}

TEST(ShardingRuleTest, MatrixEinsums) {
  RuleGolden g({2}), g4({4}), g22({2, 2});
  EXPECT_EQ(g.propagate("aten::mm", {g.t("f32[8,16](S(0))"), g.t("f32[16,4](R)")}),
            "S(0), R -> f32[8,4](S(0))");
  EXPECT_EQ(g.propagate("aten::mm", {g.t("f32[8,16](R)"), g.t("f32[16,4](S(1))")}),
            "R, S(1) -> f32[8,4](S(1))");
  EXPECT_EQ(g.propagate("aten::mm", {g.t("f32[8,16](S(1))"), g.t("f32[16,4](S(0))")}),
            "S(1), S(0) -> f32[8,4](P(sum))");
  EXPECT_EQ(g.propagate("aten::mm", {g.t("f32[8,16](S(1))"), g.t("f32[16,4](R)")}),
            "S(1), S(0) -> f32[8,4](P(sum))");
  EXPECT_EQ(g.propagate("aten::bmm", {g.t("f32[2,8,16](S(0))"), g.t("f32[2,16,4](S(0))")}),
            "S(0), S(0) -> f32[2,8,4](S(0))");
  EXPECT_EQ(g.propagate("aten::addmm", {g.t("f32[4](R)"), g.t("f32[8,16](S(0))"), g.t("f32[16,4](R)")}),
            "R, S(0), R -> f32[8,4](S(0))");
  EXPECT_EQ(g22.propagate("aten::mm", {g22.t("f32[8,16](S(0)S(1))"), g22.t("f32[16,4](RS(0))")}),
            "S(0)S(1), RS(0) -> f32[8,4](S(0)P(sum))");
  EXPECT_EQ(g4.propagate("aten::mm", {g4.t("f32[5,6](S(0))"), g4.t("f32[6,3](R)")}),
            "S(0), R -> f32[5,3](S(0))");
}

// Dim maps: a shard follows its dim through transposes and splits, moves to
// the outer dim of a flatten, and gathers when torch.chunk of the new shape
// would not match the old shards (5 rows on 4 ranks are 2,2,1,0; 15 elements
// would be 4,4,4,3).
TEST(ShardingRuleTest, Views) {
  RuleGolden g({2}), g4({4}), g22({2, 2});
  EXPECT_EQ(g.propagate("aten::view", {g.t("f32[8,16](S(0))"), IntList{4, 2, 16}}),
            "S(0) -> f32[4,2,16](S(0))");
  EXPECT_EQ(g.propagate("aten::view", {g.t("f32[8,16](S(1))"), IntList{8, 4, 4}}),
            "S(1) -> f32[8,4,4](S(1))");
  EXPECT_EQ(g.propagate("aten::view", {g.t("f32[8,16](S(1))"), IntList{128}}),
            "S(0) -> f32[128](S(0))");
  EXPECT_EQ(g.propagate("aten::transpose.int", {g.t("f32[8,16](S(0))"), 0, 1}),
            "S(0) -> f32[16,8](S(1))");
  EXPECT_EQ(g.propagate("aten::permute", {g.t("f32[2,8,16](S(2))"), IntList{2, 0, 1}}),
            "S(2) -> f32[16,2,8](S(0))");
  EXPECT_EQ(g.propagate("aten::unsqueeze", {g.t("f32[8,16](S(1))"), 0}),
            "S(1) -> f32[1,8,16](S(2))");
  EXPECT_EQ(g.propagate("aten::expand", {g.t("f32[1,16](S(1))"), IntList{8, 16}}),
            "S(1) -> f32[8,16](S(1))");
  EXPECT_EQ(g4.propagate("aten::view", {g4.t("f32[5,3](S(0))"), IntList{15}}),
            "R -> f32[15](R)");
  EXPECT_EQ(g4.propagate("aten::view", {g4.t("f32[6,4](S(1))"), IntList{6, 2, 2}}),
            "S(0) -> f32[6,2,2](S(0))");
  EXPECT_EQ(g22.propagate("aten::transpose.int", {g22.t("f32[8,16](S(0)S(1))"), 0, 1}),
            "S(0)S(1) -> f32[16,8](S(1)S(0))");
}

// A shard on a reduced dim becomes the matching Partial, except where the
// Partial would be wrong: a mean over uneven shards, a max over an empty one.
TEST(ShardingRuleTest, Reductions) {
  RuleGolden g({2}), g4({4}), g22({2, 2});
  EXPECT_EQ(g.propagate("aten::sum.dim_IntList", {g.t("f32[8,16](S(0))"), IntList{1}}),
            "S(0) -> f32[8](S(0))");
  EXPECT_EQ(g.propagate("aten::sum.dim_IntList", {g.t("f32[8,16](S(0))"), IntList{0}}),
            "S(0) -> f32[16](P(sum))");
  EXPECT_EQ(g.propagate("aten::sum", {g.t("f32[8,16](S(1))")}),
            "S(1) -> f32[](P(sum))");
  EXPECT_EQ(g.propagate("aten::mean.dim", {g.t("f32[8,16](S(0))"), IntList{0}}),
            "S(0) -> f32[16](P(avg))");
  EXPECT_EQ(g.propagate("aten::amax", {g.t("f32[8,16](S(0))"), IntList{0}}),
            "S(0) -> f32[16](P(max))");
  EXPECT_EQ(g.propagate("aten::_softmax", {g.t("f32[8,16](S(0))"), 1, false}),
            "S(0) -> f32[8,16](S(0))");
  EXPECT_EQ(g.propagate("aten::_softmax", {g.t("f32[8,16](S(1))"), 1, false}),
            "S(0) -> f32[8,16](S(0))");
  EXPECT_EQ(g.propagate("aten::sum.dim_IntList", {g.t("f32[8,16](P(sum))"), IntList{1}}),
            "P(sum) -> f32[8](P(sum))");
  EXPECT_EQ(g22.propagate("aten::sum.dim_IntList", {g22.t("f32[8,16](S(0)S(1))"), IntList{1}}),
            "S(0)S(1) -> f32[8](S(0)P(sum))");
  EXPECT_EQ(g4.propagate("aten::mean", {g4.t("f32[6](S(0))")}),
            "R -> f32[](R)");
  // f32[5,3] on 4 ranks: rows 2,2,1,0. Local means of unequal shards do not
  // average to the mean: shard the kept dim instead.
  EXPECT_EQ(g4.propagate("aten::mean.dim", {g4.t("f32[5,3](S(0))"), IntList{0}}), "S(1) -> f32[3](S(0))");
  EXPECT_EQ(g.propagate("aten::mean.dim", {g.t("f32[5,3](S(0))"), IntList{0}}), "S(1) -> f32[3](S(0))");
  // f32[3,2] on 4 ranks: rank 3's shard is empty, and amax of nothing fails.
  EXPECT_EQ(g4.propagate("aten::amax", {g4.t("f32[3,2](S(0))"), IntList{0}}), "S(1) -> f32[2](S(0))");
}

TEST(ShardingRuleTest, EmbeddingAndLayerNorm) {
  RuleGolden g({2}), g4({4});
  EXPECT_EQ(g.propagate("aten::embedding", {g.t("f32[10,4](S(0))"), g.t("i64[2,3](R)")}),
            "S(0), R -> f32[2,3,4](MaskP(0,10))");
  EXPECT_EQ(g.propagate("aten::embedding", {g.t("f32[10,4](S(1))"), g.t("i64[2,3](R)")}),
            "S(1), R -> f32[2,3,4](S(2))");
  EXPECT_EQ(g.propagate("aten::embedding", {g.t("f32[10,4](R)"), g.t("i64[2,3](S(1))")}),
            "R, S(1) -> f32[2,3,4](S(1))");
  EXPECT_EQ(g4.propagate("aten::embedding", {g4.t("f32[7,4](S(0))"), g4.t("i64[2,3](R)")}),
            "S(0), R -> f32[2,3,4](MaskP(0,7))");
  EXPECT_EQ(g.propagate("aten::native_layer_norm", {g.t("f32[8,16](S(0))"), IntList{16}, g.t("f32[16](R)"), g.t("f32[16](R)"), 1e-5}),
            "S(0), R, R -> f32[8,16](S(0)), f32[8,1](S(0)), f32[8,1](S(0))");
}

// nll_loss on batch-sharded logits: a sum stays partial, a mean needs the
// global total weight (gathers), per-sample losses stay sharded.
TEST(ShardingRuleTest, Loss) {
  RuleGolden g({2});
  EXPECT_EQ(g.propagate("aten::nll_loss_forward", {g.t("f32[8,5](S(0))"), g.t("i64[8](S(0))"), c10::IValue(), 2, -100}),
            "S(0), S(0) -> f32[](P(sum)), f32[](P(sum))");
  EXPECT_EQ(g.propagate("aten::nll_loss_forward", {g.t("f32[8,5](S(0))"), g.t("i64[8](S(0))"), c10::IValue(), 1, -100}),
            "R, R -> f32[](R), f32[](R)");
  EXPECT_EQ(g.propagate("aten::nll_loss_forward", {g.t("f32[8,5](S(0))"), g.t("i64[8](S(0))"), c10::IValue(), 0, -100}),
            "S(0), S(0) -> f32[8](S(0)), f32[](R)");
}

TEST(ShardingRuleTest, Indexing) {
  RuleGolden g({2});
  EXPECT_EQ(g.propagate("aten::gather", {g.t("f32[5](R)"), 0, g.t("i64[9](S(0))")}),
            "R, S(0) -> f32[9](S(0))");
  EXPECT_EQ(g.propagate("aten::scatter_add", {g.t("f32[5](R)"), 0, g.t("i64[9](S(0))"), g.t("f32[9](S(0))")}),
            "P(sum), S(0), S(0) -> f32[5](P(sum))");
}

// Random ops draw the global tensor and keep the shard, so their outputs
// keep the input's placements, uneven shards included. Not communication-free:
// the first random op after manual_seed syncs the ranks' generators (one
// broadcast per mesh dim, NOTE: [Generator sync]); these run on real ranks.
TEST(ShardingRuleTest, RandomOpsKeepPlacements) {
  dtp::test::run_ranks(4, [](int) {
    auto m4 = dtp::init_device_mesh("cpu", {4});
    auto m22 = dtp::init_device_mesh("cpu", {2, 2});
    auto t = [](const dtp::DeviceMesh& m, std::vector<int64_t> shape, dtp::Placements p) {
      return dtp::distribute_tensor(at::zeros(shape), m, p);
    };
    const at::Tensor a = t(m4, {5, 3}, {dtp::Shard(0)}), b = t(m4, {5, 3}, {dtp::Shard(1)});
    const at::Tensor c = t(m22, {4, 6}, {dtp::Shard(1), dtp::Shard(0)}), d = t(m22, {4, 6}, {dtp::Replicate(), dtp::Shard(1)});
    dtp::manual_seed(1);
    dtp::CommCounter comm;
    EXPECT_EQ(dtp::dtensor_spec(at::rand_like(a)).str(), "f32[5,3](S(0))");
    EXPECT_EQ(dtp::dtensor_spec(at::dropout(b, 0.5, true)).str(), "f32[5,3](S(1))");
    EXPECT_EQ(dtp::dtensor_spec(at::randn_like(c)).str(), "f32[4,6](S(1)S(0))");
    EXPECT_EQ(dtp::dtensor_spec(at::dropout(d, 0.1, true)).str(), "f32[4,6](RS(1))");
    EXPECT_EQ(comm.count(dtp::CollectiveType::Broadcast), 3) << comm.str();  // m4 once, m22 once per dim
    EXPECT_EQ(comm.total_count(), 3) << comm.str();
  });
}

TEST(ShardingRuleTest, NoRuleIsAClearError) {
  RuleGolden g({2});
  EXPECT_EQ(g.propagate("aten::logcumsumexp", {g.t("f32[8,16](S(0))"), 0}).rfind("error: dtp: no sharding rule for aten::logcumsumexp (inputs: f32[8", 0), 0u);
}

}  // namespace
