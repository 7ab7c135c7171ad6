// DeviceMesh::flatten (PyTorch's DeviceMesh._flatten) on (2, 2) and (2, 2, 2)
// meshes: the flattened mesh's ranks, coordinates and group checked with a
// real all_reduce, its name registered on the whole mesh, one group per name
// (identity and collective counts), a DTensor over it against one device, and
// every error. See NOTE: [Flattened dimensions] in src/mesh/flatten.cpp.
#include "dist.h"
#include "dtp/comm_counter.h"
#include "dtp/device_mesh.h"
#include "dtp/dtensor.h"
#include "mesh/fake_mesh.h"
#include "mesh/flatten.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>

using dtp::test::error_of;
using dtp::test::expect_error;
using dtp::test::run_ranks;

namespace {

// Checks a 1-D mesh over `ranks` (global ranks, in order) against its group:
// sizes, this rank's place, and an all_reduce of the global ranks.
void expectOneDimOver(const dtp::DeviceMesh& flat, const std::vector<int>& ranks, int rank) {
  const int64_t local = std::find(ranks.begin(), ranks.end(), rank) - ranks.begin();
  ASSERT_LT(local, static_cast<int64_t>(ranks.size())) << "rank " << rank << " is not in its own flattened mesh";
  EXPECT_EQ(flat.ndim(), 1);
  EXPECT_EQ(flat.size(), static_cast<int64_t>(ranks.size()));
  EXPECT_TRUE(flat.mesh().equal(at::tensor(std::vector<int64_t>(ranks.begin(), ranks.end()), at::kLong)))
      << flat.mesh();
  EXPECT_EQ(flat.get_coordinate(), std::vector<int64_t>{local});
  EXPECT_EQ(flat.get_local_rank(), local);
  const dtp::ProcessGroup g = flat.get_group();
  EXPECT_EQ(g.global_ranks(), ranks);
  EXPECT_EQ(g.rank(), local);
  at::Tensor t = at::full({1}, rank, at::kDouble);
  g.all_reduce(t);
  EXPECT_EQ(t.item<double>(), std::accumulate(ranks.begin(), ranks.end(), 0.0)) << flat;
}

}  // namespace

TEST(DeviceMeshFlattenTest, TwoByTwoFlattensToTheWholeWorld) {
  run_ranks(4, [](int rank) {
    auto mesh = dtp::init_device_mesh("cpu", {2, 2}, {"dp_replicate", "dp_shard"});
    dtp::CommCounter comm;
    auto dp = mesh.flatten();  // default name: the dims' names joined by "_"
    EXPECT_EQ(dp.str(), "DeviceMesh((dp_replicate_dp_shard=4), cpu)");
    EXPECT_EQ(comm.count(dtp::CollectiveType::AllGather), 2) << "the ranks agree once on the name: " << comm.str();
    expectOneDimOver(dp, {0, 1, 2, 3}, rank);
    EXPECT_TRUE(dp.get_group() == dtp::default_process_group()) << "all ranks: the world group, not a new one";
    auto named = mesh[{"dp_replicate", "dp_shard"}].flatten("dp");
    EXPECT_EQ(named.str(), "DeviceMesh((dp=4), cpu)");
    EXPECT_TRUE(named.get_group() == dp.get_group());
    EXPECT_TRUE(mesh["dp"] == named);
  });
}

TEST(DeviceMeshFlattenTest, ThreeDimFlattensRowMajorAndRegistersTheName) {
  run_ranks(8, [](int rank) {
    auto mesh = dtp::init_device_mesh("cpu", {2, 2, 2}, {"dp_replicate", "dp_shard", "tp"});
    const int t = rank % 2;
    auto dp = mesh[{"dp_replicate", "dp_shard"}].flatten("dp");
    EXPECT_EQ(dp.str(), "DeviceMesh((dp=4), cpu)");
    EXPECT_EQ(dp.mesh_dim_names(), std::vector<std::string>{"dp"});
    expectOneDimOver(dp, {t, t + 2, t + 4, t + 6}, rank);  // rank 5 -> 1,3,5,7, local rank 2
    EXPECT_EQ(dp.get_local_rank("dp"), rank / 2);

    // The whole mesh knows "dp" now, alone and next to tp.
    EXPECT_TRUE(mesh["dp"] == dp);
    EXPECT_TRUE(mesh["dp"].get_group() == dp.get_group());
    auto dp_tp = mesh[{"dp", "tp"}];
    EXPECT_EQ(dp_tp.str(), "DeviceMesh((dp=4, tp=2), cpu)");
    EXPECT_TRUE(dp_tp.mesh().equal(at::arange(8, at::kLong).view({4, 2}))) << dp_tp.mesh();
    EXPECT_EQ(dp_tp.get_coordinate(), (std::vector<int64_t>{rank / 2, t}));
    EXPECT_TRUE(dp_tp.get_group("dp") == dp.get_group());
    EXPECT_TRUE(dp_tp.get_group("tp") == mesh.get_group("tp"));
    // A slice with a flattened dimension flattens again, over all of them.
    auto all = dp_tp.flatten();
    EXPECT_EQ(all.str(), "DeviceMesh((dp_tp=8), cpu)");
    expectOneDimOver(all, {0, 1, 2, 3, 4, 5, 6, 7}, rank);

    // The inner pair: ranks that share dp_replicate.
    const int r0 = rank / 4 * 4;
    auto shard_tp = mesh[{"dp_shard", "tp"}].flatten();
    EXPECT_EQ(shard_tp.str(), "DeviceMesh((dp_shard_tp=4), cpu)");
    expectOneDimOver(shard_tp, {r0, r0 + 1, r0 + 2, r0 + 3}, rank);
    auto rep_shard_tp = mesh[{"dp_replicate", "dp_shard_tp"}];
    EXPECT_EQ(rep_shard_tp.shape(), (std::vector<int64_t>{2, 4}));
    EXPECT_EQ(rep_shard_tp.get_coordinate(), (std::vector<int64_t>{rank / 4, rank % 4}));
    EXPECT_TRUE(rep_shard_tp.get_group(1) == shard_tp.get_group());
  });
}

// Flattening again under the same name, slicing by the name, and HSDP's own
// group over the same dimensions all share ONE group: no collective, and the
// same ProcessGroup object (== compares identity).
TEST(DeviceMeshFlattenTest, RepeatedFlattenSharesTheGroup) {
  run_ranks(8, [](int) {
    auto mesh = dtp::init_device_mesh("cpu", {2, 2, 2}, {"dp_replicate", "dp_shard", "tp"});
    auto dp = mesh[{"dp_replicate", "dp_shard"}].flatten("dp");
    dtp::CommCounter comm;
    auto again = mesh[{"dp_replicate", "dp_shard"}].flatten("dp");
    auto sliced = mesh["dp"];
    const dtp::ProcessGroup hsdp = dtp::flattened_group(mesh, {0, 1}, "test");
    EXPECT_EQ(comm.total_count(), 0) << comm.str();
    EXPECT_TRUE(again.get_group() == dp.get_group());
    EXPECT_TRUE(sliced.get_group() == dp.get_group());
    EXPECT_TRUE(hsdp == dp.get_group());
    EXPECT_TRUE(again == dp);
    // The flattened mesh under its own name is itself.
    EXPECT_EQ(dp.flatten().id(), dp.id());
    EXPECT_EQ(dp.flatten("dp").id(), dp.id());
  });
}

// A 1-D mesh flattens to itself under its own name (PyTorch's); under a new
// name it is registered and keeps its dimension's group (PyTorch would make a
// second group over the same ranks).
TEST(DeviceMeshFlattenTest, OneDimMeshFlattensToItself) {
  run_ranks(4, [](int rank) {
    auto mesh = dtp::init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    auto tp = mesh["tp"];
    EXPECT_EQ(tp.flatten().id(), tp.id());
    EXPECT_EQ(tp.flatten("tp").id(), tp.id());
    auto renamed = tp.flatten("tp_again");
    EXPECT_EQ(renamed.str(), "DeviceMesh((tp_again=2), cpu)");
    EXPECT_TRUE(renamed.get_group() == mesh.get_group("tp"));
    EXPECT_TRUE(mesh["tp_again"].get_group() == mesh.get_group("tp"));
    expectOneDimOver(renamed, {rank / 2 * 2, rank / 2 * 2 + 1}, rank);
  });
}

// f64[10,3](S(0)) over the flattened dp of (dp_replicate=2, dp_shard=2, tp=2):
// local rows 3,3,3,1 by dp coordinate; the round trip equals the one-device
// tensor exactly, with one all_gather over the flattened group.
TEST(DeviceMeshFlattenTest, DTensorShardOverFlattenedDimMatchesOneDevice) {
  const at::Tensor full = at::arange(30, at::kDouble).view({10, 3}) * 0.25 - 1.0;
  run_ranks(8, [&](int rank) {
    auto mesh = dtp::init_device_mesh("cpu", {2, 2, 2}, {"dp_replicate", "dp_shard", "tp"});
    auto dp = mesh[{"dp_replicate", "dp_shard"}].flatten("dp");
    at::Tensor d = dtp::distribute_tensor(full, dp, {dtp::Shard(0)});
    const auto rows = dtp::test::chunk_sizes(10, 4);
    const int64_t local = rank / 2;
    const int64_t start = 3 * local;
    at::Tensor mine = dtp::to_local(d);
    ASSERT_EQ(mine.size(0), rows[local]);
    EXPECT_EQ((mine - full.narrow(0, start, rows[local])).abs().max().item<double>(), 0.0)
        << "rank " << rank << " holds the wrong rows";
    dtp::CommCounter comm;
    at::Tensor back = dtp::full_tensor(d);
    EXPECT_EQ(comm.count(dtp::CollectiveType::AllGather, dp.get_group().global_ranks()), 1) << comm.str();
    EXPECT_EQ(comm.total_count(), 1) << comm.str();
    EXPECT_EQ((back - full).abs().max().item<double>(), 0.0);

    // 2-D: (dp=4, tp=2) with S(0) on dp and S(1) on tp.
    at::Tensor d2 = dtp::distribute_tensor(full, mesh[{"dp", "tp"}], {dtp::Shard(0), dtp::Shard(1)});
    EXPECT_EQ(dtp::to_local(d2).sizes().vec(), (std::vector<int64_t>{rows[local], rank % 2 == 0 ? 2 : 1}));
    EXPECT_EQ((dtp::full_tensor(d2) - full).abs().max().item<double>(), 0.0);
  });
}

TEST(DeviceMeshFlattenTest, ErrorsNameTheThingAndTheFix) {
  run_ranks(8, [](int) {
    auto mesh = dtp::init_device_mesh("cpu", {2, 2, 2}, {"dp_replicate", "dp_shard", "tp"});
    const std::string m = "DeviceMesh((dp_replicate=2, dp_shard=2, tp=2), cpu)";
    expect_error([&] { mesh[{"dp_replicate", "dp_shard"}].flatten("tp"); },
                 {"DeviceMesh::flatten: name 'tp' for (dp_replicate, dp_shard) of " + m +
                      ": got the name of one of its own dimensions, expected a new name. Pass another name"});
    auto dp = mesh[{"dp_replicate", "dp_shard"}].flatten("dp");
    expect_error([&] { mesh[{"dp_shard", "tp"}].flatten("dp"); },
                 {"DeviceMesh::flatten: name 'dp' for (dp_shard, tp) of " + m +
                      ": got a name already given to the flattened (dp_replicate, dp_shard), expected a new name. "
                      "Pass another name, or flatten (dp_replicate, dp_shard) to get 'dp' again."});
    expect_error([&] { mesh[{"tp", "dp"}]; },
                 {"DeviceMesh: slicing " + m + " by tp,dp: got dimensions (tp, dp_replicate, dp_shard), expected "
                  "adjacent dimensions in mesh order, each once."});
    expect_error([&] { mesh[{"dp", "dp_shard"}]; }, "got dimensions (dp_replicate, dp_shard, dp_shard)");
    expect_error([&] { mesh[{"dp", "nope"}]; },
                 {"DeviceMesh: dimension 'nope' of " + m + ": got no such name, expected one of (dp_replicate, "
                  "dp_shard, tp) or a flattened one (dp). Use one of those names, or flatten the dimensions first."});
    // A slice does not know the whole mesh's flattened names (PyTorch's neither).
    expect_error([&] { mesh[{"dp_shard", "tp"}]["dp"]; }, "no dimension named 'dp'");
    auto unnamed = dtp::init_device_mesh("cpu", {2, 4});
    expect_error([&] { unnamed.flatten("x"); },
                 {"DeviceMesh::flatten: dimension names for DeviceMesh((2, 4), cpu): got none",
                  "Give init_device_mesh mesh_dim_names."});
    // The failed calls left no state behind: "dp" still means (dp_replicate, dp_shard).
    EXPECT_TRUE(mesh["dp"].get_group() == dp.get_group());
  });
  expect_error([] { dtp::make_fake_device_mesh({2, 2}, {0, 1}, {"a", "b"}).flatten(); },
               {"DeviceMesh::flatten: process groups for DeviceMesh((a=2, b=2), cpu): got a mesh without them",
                "Build the mesh with init_device_mesh."});
}

// Registering a name is collective over the whole mesh: a rank that names
// other dimensions, or skips the call, fails every rank naming the call
// (NOTE: [Ranks agree on arguments]), rather than leaving the groups crossed
// or the ranks waiting in the group creation.
TEST(DeviceMeshFlattenTest, RanksThatDisagreeOrSkipFailNamingFlatten) {
  run_ranks(4, [](int rank) {
    auto mesh = dtp::init_device_mesh("cpu", {2, 2}, {"a", "b"});
    expect_error([&] { mesh.flatten(rank == 3 ? "other" : "ab"); },
                 {"DeviceMesh::flatten: the ranks passed different names and dimensions (every rank must pass the "
                  "same):", "rank 0: 'ab = (a, b)'", "rank 3: 'other = (a, b)'"});
  });
  run_ranks(4, [](int rank) {
    auto mesh = dtp::init_device_mesh("cpu", {2, 2}, {"a", "b"});
    if (rank == 3) return;  // never calls flatten
    expect_error([&] { mesh.flatten("ab"); },
                 {"dtp: DeviceMesh::flatten on global rank " + std::to_string(rank), "global rank 3 did not reach it",
                  "DeviceMesh::flatten is collective: every rank of the group must call DeviceMesh::flatten"});
  }, std::chrono::seconds(3));
}
