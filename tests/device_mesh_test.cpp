// DeviceMesh on (4), (2,2) and (2,2,2): coordinates, sub-groups per dimension
// checked with real collectives, slicing, printing and every error.
#include "dist.h"
#include "dtp/device_mesh.h"
#include "dtp/dtensor.h"

#include <ATen/ATen.h>

using dtp::test::run_ranks;

namespace {

// Sum of the global ranks in this rank's group along `dim`, computed from the
// mesh layout alone.
double expectedGroupSum(const dtp::DeviceMesh& mesh, int64_t dim) {
  at::Tensor ranks = mesh.mesh();
  auto coord = mesh.get_coordinate();
  for (int64_t d = mesh.ndim() - 1; d >= 0; --d) {
    if (d != dim) ranks = ranks.select(d, coord[d]);
  }
  return ranks.sum().item<double>();
}

void checkEveryDimGroup(const dtp::DeviceMesh& mesh) {
  for (int64_t d = 0; d < mesh.ndim(); ++d) {
    auto g = mesh.get_group(d);
    ASSERT_TRUE(g.valid());
    EXPECT_EQ(g.size(), mesh.size(d));
    EXPECT_EQ(g.rank(), mesh.get_local_rank(d));
    at::Tensor t = at::full({1}, mesh.get_rank(), at::kDouble);
    g.all_reduce(t);
    EXPECT_EQ(t.item<double>(), expectedGroupSum(mesh, d)) << mesh << " dim " << d;
  }
}

TEST(DeviceMeshTest, OneDimMeshOfFour) {
  run_ranks(4, [](int rank) {
    auto mesh = dtp::init_device_mesh("cpu", {4}, {"tp"});
    EXPECT_EQ(mesh.str(), "DeviceMesh((tp=4), cpu)");
    EXPECT_EQ(mesh.ndim(), 1);
    EXPECT_EQ(mesh.get_local_rank("tp"), rank);
    EXPECT_EQ(mesh.get_coordinate(), std::vector<int64_t>{rank});
    checkEveryDimGroup(mesh);
  });
}

TEST(DeviceMeshTest, TwoByTwoGroupsFollowRowsAndColumns) {
  run_ranks(4, [](int rank) {
    auto mesh = dtp::init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    EXPECT_EQ(mesh.str(), "DeviceMesh((dp=2, tp=2), cpu)");
    EXPECT_EQ(mesh.get_coordinate(), (std::vector<int64_t>{rank / 2, rank % 2}));
    // tp groups are rows {0,1},{2,3}; dp groups are columns {0,2},{1,3}.
    EXPECT_EQ(mesh.get_group("tp").global_ranks(),
              (std::vector<int>{rank / 2 * 2, rank / 2 * 2 + 1}));
    EXPECT_EQ(mesh.get_group("dp").global_ranks(), (std::vector<int>{rank % 2, rank % 2 + 2}));
    checkEveryDimGroup(mesh);

    auto tp = mesh["tp"];
    EXPECT_EQ(tp.str(), "DeviceMesh((tp=2), cpu)");
    EXPECT_EQ(tp.get_local_rank(), rank % 2);
    EXPECT_TRUE(tp.get_group(0) == mesh.get_group(1));  // reused, not re-created
    EXPECT_TRUE(tp.mesh().equal(mesh.mesh()[rank / 2]));
    checkEveryDimGroup(tp);
    EXPECT_TRUE((mesh[{"dp", "tp"}] == mesh));
  });
}

TEST(DeviceMeshTest, ThreeDimMeshSlicesAndGroups) {
  run_ranks(8, [](int rank) {
    auto mesh = dtp::init_device_mesh("cpu", {2, 2, 2}, {"pp", "dp", "tp"});
    EXPECT_EQ(mesh.str(), "DeviceMesh((pp=2, dp=2, tp=2), cpu)");
    checkEveryDimGroup(mesh);
    auto dp_tp = mesh[{"dp", "tp"}];
    EXPECT_EQ(dp_tp.shape(), (std::vector<int64_t>{2, 2}));
    EXPECT_TRUE(dp_tp.mesh().equal(mesh.mesh()[rank / 4]));
    checkEveryDimGroup(dp_tp);
    auto pp = mesh["pp"];
    EXPECT_TRUE(pp.mesh().equal(at::tensor({rank % 4, rank % 4 + 4}, at::kLong)));
    checkEveryDimGroup(pp);
    EXPECT_THROW((mesh[{"pp", "tp"}]), c10::Error);  // not adjacent
    EXPECT_THROW((mesh[{"tp", "dp"}]), c10::Error);  // out of order
  });
}


TEST(DeviceMeshTest, ErrorsNameTheProblem) {
  run_ranks(4, [](int) {
    EXPECT_NE(dtp::test::error_of([] { dtp::init_device_mesh("cpu", {3}); })
                  .find("holds 3 ranks, but the world has 4"),
              std::string::npos);
    EXPECT_NE(dtp::test::error_of([] { dtp::init_device_mesh("cpu", {2, 2}, {"tp", "tp"}); })
                  .find("duplicate mesh dim name 'tp'"),
              std::string::npos);
    EXPECT_NE(dtp::test::error_of([] { dtp::init_device_mesh("cpu", {2, 2}, {"tp"}); })
                  .find("got 1 mesh_dim_names for a 2-D mesh"),
              std::string::npos);
    EXPECT_NE(dtp::test::error_of([] { dtp::init_device_mesh("tpu", {4}); }).find("device_type 'tpu'"),
              std::string::npos);
    auto mesh = dtp::init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    EXPECT_NE(dtp::test::error_of([&] { mesh["pp"]; }).find("no dimension named 'pp'"), std::string::npos);
    EXPECT_NE(dtp::test::error_of([&] { mesh[{"tp", "dp"}]; })
                  .find("must be adjacent dimensions in mesh order"),
              std::string::npos);
    EXPECT_NE(dtp::test::error_of([&] { mesh.size(2); }).find("dim 2 out of range"), std::string::npos);
    auto unnamed = dtp::init_device_mesh("cpu", {4});
    EXPECT_NE(dtp::test::error_of([&] { unnamed["tp"]; }).find("Give init_device_mesh mesh_dim_names"),
              std::string::npos);
  });
}

// Default-constructed handles and a CUDA mesh without CUDA are errors at the
// API boundary, not segfaults or tensors silently left on the CPU.
TEST(DeviceMeshTest, InvalidHandlesAndMissingCudaAreErrors) {
  using dtp::test::expect_error;
  const std::vector<std::string> mesh_msg{"DeviceMesh: this handle is invalid", "init_device_mesh"};
  const std::vector<std::string> pg_msg{"ProcessGroup: this handle is invalid", "default_process_group"};
  dtp::DeviceMesh mesh;
  expect_error([&] { mesh.size(); }, mesh_msg);
  expect_error([&] { mesh.get_group(0); }, mesh_msg);
  expect_error([&] { mesh["tp"]; }, mesh_msg);
  expect_error([&] { dtp::distribute_tensor(at::ones({4}), mesh, {dtp::Shard(0)}); }, mesh_msg);
  EXPECT_EQ(mesh.str(), "DeviceMesh(invalid)");
  dtp::ProcessGroup pg;
  expect_error([&] { pg.rank(); }, pg_msg);
  expect_error([&] { pg.all_reduce(at::ones({2})); }, pg_msg);
  expect_error([&] { pg.barrier(); }, pg_msg);
  expect_error([&] { pg.new_group({0}); }, pg_msg);
  EXPECT_EQ(pg.str(), "ProcessGroup(invalid)");
  if (!at::hasCUDA()) {
    run_ranks(2, [](int) {
      dtp::test::expect_error([] { dtp::init_device_mesh("cuda", {2}); }, {"no CUDA device", "Use \"cpu\""});
    });
  }
}

}  // namespace
