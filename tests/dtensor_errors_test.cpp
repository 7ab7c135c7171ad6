// Loud errors instead of silent fallbacks: unsupported ops, mixed tensors,
// different meshes, in-place ops that would need their target moved; and
// the two opt-in modes that relax them.
#include "close.h"
#include "dist.h"
#include "parity.h"

#include "dtp/comm_counter.h"

using namespace dtp;
using dtp::test::data;
using dtp::test::run_ranks;

namespace {


#define EXPECT_ERROR(stmt, text) \
  EXPECT_NE(dtp::test::error_of([&] { stmt; }).find(text), std::string::npos) << dtp::test::error_of([&] { stmt; })

TEST(DTensorErrorsTest, OpWithoutRuleNamesOpInputsAndRemedy) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    at::Tensor x = distribute_tensor(data({5, 3}).to(at::kFloat), mesh, {Shard(0)});
    const std::string msg = dtp::test::error_of([&] { at::logcumsumexp(x, 0); });
    EXPECT_NE(msg.find("dtp: no sharding rule for aten::logcumsumexp (inputs: f32[5,3](S(0)), 0)"),
              std::string::npos) << msg;
    EXPECT_NE(msg.find("ReplicateFallbackGuard"), std::string::npos) << msg;
  });
}

TEST(DTensorErrorsTest, ReplicateFallbackGathersRunsAndMatches) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    at::Tensor full = data({5, 3});
    at::Tensor x = distribute_tensor(full, mesh, {Shard(0)});
    ReplicateFallbackGuard fallback;
    CommCounter comm;
    at::Tensor y = at::logcumsumexp(x, 0);
    EXPECT_EQ(comm.count(CollectiveType::AllGather), 1);
    EXPECT_EQ(placements(y), Placements{Replicate()});
    EXPECT_CLOSE(full_tensor(y), at::logcumsumexp(full, 0), 1e-5, 1e-8);
  });
}

TEST(DTensorErrorsTest, MixedPlainTensorIsAnErrorUnlessImplicitReplication) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    at::Tensor full = data({4, 3});
    at::Tensor x = distribute_tensor(full, mesh, {Shard(0)});
    EXPECT_ERROR(x + at::ones({3}, at::kDouble),
                 "mix of plain at::Tensor and DTensor arguments: 'other' (f64[3]) is a plain tensor");
    // 0-dim plain tensors are scalars.
    EXPECT_CLOSE(full_tensor(x * at::scalar_tensor(2.0, at::kDouble)), full * 2, 1e-5, 1e-8);
    ImplicitReplicationGuard implicit;
    at::Tensor y = x + at::ones({3}, at::kDouble);
    EXPECT_CLOSE(full_tensor(y), full + 1, 1e-5, 1e-8);
  });
}

TEST(DTensorErrorsTest, DTensorsOnDifferentMeshesAreAnError) {
  run_ranks(4, [](int) {
    auto a = init_device_mesh("cpu", {4});
    auto b = init_device_mesh("cpu", {2, 2});
    at::Tensor x = distribute_tensor(data({4, 4}), a, {Replicate()});
    at::Tensor y = distribute_tensor(data({4, 4}), b, {Replicate(), Replicate()});
    EXPECT_ERROR(x + y, "got DTensors on different meshes: DeviceMesh((4,), cpu) and DeviceMesh((2, 2), cpu)");
  });
}

TEST(DTensorErrorsTest, InPlaceOpThatWouldMoveItsTargetIsAnError) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    at::Tensor a = distribute_tensor(data({4, 2}), mesh, {Shard(1)});
    at::Tensor b = distribute_tensor(data({2, 3}), mesh, {Shard(0)});
    at::Tensor p = at::mm(a, b);  // P(sum)
    EXPECT_ERROR(p.exp_(), "writes an argument whose placement would have to change");
  });
}

TEST(DTensorErrorsTest, ApiMisuseIsNamed) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    at::Tensor x = distribute_tensor(data({4, 2}), mesh, {Shard(0)});
    EXPECT_ERROR(to_local(data({2})), "dtp::to_local: expected a DTensor");
    EXPECT_ERROR(distribute_tensor(x, mesh, {Replicate()}), "already a DTensor f64[4,2](S(0))");
    EXPECT_ERROR(distribute_tensor(data({4}), mesh, {Shard(1)}), "S(1) is out of range for a 1-D tensor");
    EXPECT_ERROR(distribute_tensor(data({4}), mesh, {Shard(0), Replicate()}),
                 "got 2 placements (S(0)R) for DeviceMesh((2,), cpu)");
    EXPECT_ERROR(redistribute(x, mesh, {Shard(2)}), "S(2) is out of range");
  });
}

}  // namespace
