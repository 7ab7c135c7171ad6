// Convolutions on DTensors (#26): conv1d and conv2d, forward and backward,
// batch-sharded (3 entries: uneven), in-channel-sharded (a Partial output)
// and out-channel-sharded (6 channels: uneven on 4), with and without bias,
// against one device in float64 on meshes (2), (4) and (2,2); and small
// CNNs (conv, relu, conv, mean; conv, relu, max-pool, conv, relu, avg-pool,
// linear) trained by their gradients.
#include "mesh_test.h"
#include "parity.h"

#include "dtp/comm_counter.h"

#include <ATen/ATen.h>

using namespace dtp;
using dtp::test::data;
using dtp::test::expect_parity;
using V = std::vector<at::Tensor>;

namespace {

using Conv = dtp::test::MeshTest;

TEST_P(Conv, Conv1dAndConv2dEqualOneDevice) {
  run([&](const DeviceMesh& mesh, int64_t) {
    struct Case {
      const char* name;
      Placement x, w, b;
    };
    const std::vector<Case> cases = {{"batch", Shard(0), Replicate(), Replicate()},
                                     {"in-channel", Shard(1), Shard(1), Replicate()},
                                     {"out-channel", Replicate(), Shard(0), Shard(0)},
                                     {"replicated", Replicate(), Replicate(), Replicate()}};
    const at::Tensor x2 = data({3, 4, 5, 5}), w2 = data({6, 4, 3, 3}, 0.3) * 0.3, b = data({6}, 0.6);
    const at::Tensor x1 = data({3, 4, 7}), w1 = data({6, 4, 3}, 0.2) * 0.3;
    for (const Case& c : cases) {
      SCOPED_TRACE(c.name);
      expect_parity(mesh, {x2, w2, b}, {on(mesh, c.x), on(mesh, c.w), on(mesh, c.b)},
                    [](const V& t) { return at::conv2d(t[0], t[1], t[2], {1, 1}, {1, 1}); });
      expect_parity(mesh, {x2, w2}, {on(mesh, c.x), on(mesh, c.w)},
                    [](const V& t) { return at::conv2d(t[0], t[1], {}, {2, 2}); });
      expect_parity(mesh, {x1, w1, b}, {on(mesh, c.x), on(mesh, c.w), on(mesh, c.b)},
                    [](const V& t) { return at::conv1d(t[0], t[1], t[2], {1}, {2}, {2}); });
    }
    // A small CNN: batch-sharded activations, replicated weights.
    const at::Tensor w3 = data({5, 6, 3, 3}, 0.9) * 0.2;
    expect_parity(mesh, {x2, w2, b, w3}, {on(mesh, Shard(0)), on(mesh, Replicate()), on(mesh, Replicate()),
                                          on(mesh, Replicate())},
                  [](const V& t) {
                    const at::Tensor h = at::relu(at::conv2d(t[0], t[1], t[2], {1, 1}, {1, 1}));
                    return at::conv2d(h, t[3]).mean({2, 3});
                  });
    // With pooling and a classifier: conv, relu, max-pool, conv, relu, avg-pool, linear.
    const at::Tensor wl = data({4, 5}, 1.1) * 0.5;
    expect_parity(mesh, {x2, w2, b, w3, wl},
                  {on(mesh, Shard(0)), on(mesh, Replicate()), on(mesh, Replicate()), on(mesh, Replicate()),
                   on(mesh, Replicate())},
                  [](const V& t) {
                    at::Tensor h = at::max_pool2d(at::relu(at::conv2d(t[0], t[1], t[2], {1, 1}, {1, 1})), {2, 2});
                    h = at::avg_pool2d(at::relu(at::conv2d(h, t[3], {}, {1, 1}, {1, 1})), {2, 2});
                    return at::linear(h.flatten(1), t[4]);
                  });
  });
}

TEST_P(Conv, ShardedAlikeNeedsNoCollectiveInForward) {
  run([&](const DeviceMesh& mesh, int64_t) {
    at::NoGradGuard no_grad;
    const at::Tensor x = distribute_tensor(data({3, 4, 5, 5}), mesh, on(mesh, Shard(0)));
    const at::Tensor w = distribute_tensor(data({6, 4, 3, 3}), mesh, on(mesh, Replicate()));
    const at::Tensor wo = distribute_tensor(data({6, 4, 3, 3}), mesh, on(mesh, Shard(0)));
    const at::Tensor xr = distribute_tensor(data({3, 4, 5, 5}), mesh, on(mesh, Replicate()));
    CommCounter comm;
    EXPECT_EQ(placements(at::conv2d(x, w)), on(mesh, Shard(0)));
    EXPECT_EQ(placements(at::conv2d(xr, wo)), on(mesh, Shard(1)));
    // Pooling keeps a batch or a channel shard (no graph: max_pool2d's own path).
    const at::Tensor pooled = at::max_pool2d(x, {2, 2});
    EXPECT_EQ(placements(pooled), on(mesh, Shard(0)));
    EXPECT_TRUE(full_tensor(pooled).equal(at::max_pool2d(data({3, 4, 5, 5}), {2, 2})));
    EXPECT_EQ(placements(at::avg_pool2d(at::conv2d(xr, wo), {2, 2})), on(mesh, Shard(1)));
    EXPECT_EQ(comm.total_count(), 1) << comm.str();  // full_tensor's all-gather
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, Conv, dtp::test::mesh_shapes(), dtp::test::mesh_name);

}  // namespace
