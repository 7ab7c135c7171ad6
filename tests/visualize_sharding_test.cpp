// visualize_sharding's text for fixed cases: 1-D and 2-D tensors on 1-D and
// 2-D meshes, uneven and empty shards, replicas and a pending reduction. Each
// rank also finds its own shard (to_local's shape) where the text puts it.
#include "dist.h"
#include "parity.h"

#include "dtp/dtensor.h"
#include "dtp/visualize_sharding.h"

using namespace dtp;
using dtp::test::data;
using dtp::test::run_ranks;

namespace {

// The block this rank holds, as the text writes it.
std::string myBlock(const at::Tensor& t) {
  const DTensorSpec& s = dtensor_spec(t);
  const auto off = s.local_offset();
  std::string b = "[";
  for (size_t d = 0; d < off.size(); ++d)
    b += (d ? ", " : "") + std::to_string(off[d]) + ":" + std::to_string(off[d] + to_local(t).size(d));
  return b + "]";
}

void expectText(const at::Tensor& t, const std::string& want) {
  const std::string got = visualize_sharding(t);
  EXPECT_EQ(got, want);
  EXPECT_NE(got.find("| " + myBlock(t) + " |"), std::string::npos) << got;
}

TEST(VisualizeSharding, OneDimMeshUnevenAndEmpty) {
  run_ranks(4, [](int) {
    auto mesh = init_device_mesh("cpu", {4}, {"tp"});
    expectText(distribute_tensor(data({5, 3}), mesh, {Shard(0)}),
               "f64[5,3] (S(0)) on DeviceMesh((tp=4), cpu)\n"
               "| block | ranks (tp) |\n|---|---|\n"
               "| [0:2, 0:3] | 0 (0) |\n| [2:4, 0:3] | 1 (1) |\n| [4:5, 0:3] | 2 (2) |\n| [5:5, 0:3] | 3 (3) |\n"
               "tp: S(0) splits dim 0 in 4\n");
    expectText(distribute_tensor(data({3}), mesh, {Replicate()}),
               "f64[3] (R) on DeviceMesh((tp=4), cpu)\n"
               "| block | ranks (tp) |\n|---|---|\n"
               "| [0:3] | 0 (0), 1 (1), 2 (2), 3 (3) |\n"
               "tp: R, the ranks of a row differing only in tp hold equal copies\n");
  });
}

TEST(VisualizeSharding, TwoDimMeshShardsReplicasAndPartial) {
  run_ranks(4, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    expectText(distribute_tensor(data({5, 3}), mesh, {Shard(0), Shard(1)}),
               "f64[5,3] (S(0)S(1)) on DeviceMesh((dp=2, tp=2), cpu)\n"
               "| block | ranks (dp, tp) |\n|---|---|\n"
               "| [0:3, 0:2] | 0 (0, 0) |\n| [0:3, 2:3] | 1 (0, 1) |\n| [3:5, 0:2] | 2 (1, 0) |\n| [3:5, 2:3] | 3 (1, 1) |\n"
               "dp: S(0) splits dim 0 in 2\ntp: S(1) splits dim 1 in 2\n");
    // Both mesh dims split dim 0: rows 0:3 then 3:5 by dp, each halved by tp.
    expectText(distribute_tensor(data({5}), mesh, {Shard(0), Shard(0)}),
               "f64[5] (S(0)S(0)) on DeviceMesh((dp=2, tp=2), cpu)\n"
               "| block | ranks (dp, tp) |\n|---|---|\n"
               "| [0:2] | 0 (0, 0) |\n| [2:3] | 1 (0, 1) |\n| [3:4] | 2 (1, 0) |\n| [4:5] | 3 (1, 1) |\n"
               "dp: S(0) splits dim 0 in 2\ntp: S(0) splits dim 0 in 2\n");
    // A pending sum over tp, replicas over dp.
    at::Tensor partial = from_local(at::full({4}, double(rank), at::kDouble), mesh, {Replicate(), Partial()});
    expectText(partial,
               "f64[4] (RP(sum)) on DeviceMesh((dp=2, tp=2), cpu)\n"
               "| block | ranks (dp, tp) |\n|---|---|\n"
               "| [0:4] | 0 (0, 0), 1 (0, 1), 2 (1, 0), 3 (1, 1) |\n"
               "dp: R, the ranks of a row differing only in dp hold equal copies\n"
               "tp: P(sum), pending: the ranks of a row differing only in tp hold parts whose sum is the block\n");
  });
}

TEST(VisualizeSharding, PlainTensorIsANamedError) {
  dtp::test::expect_error([] { visualize_sharding(at::ones({2})); }, {"visualize_sharding: the tensor is not a DTensor"});
}

}  // namespace
