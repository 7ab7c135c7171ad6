// at::scaled_dot_product_attention on DTensors (#26; libtorch 2.x, where
// DTP_HAS_SDPA): q, k, v [B, H, L, E] sharded on the batch or the head dim
// (unevenly: 3 batch entries, 5 heads) or replicated, causal, with a boolean
// mask [L, S] (replicated) and with a float mask [B, H, L, S] (sharded with
// q; it requires grad, so libtorch takes its math path, whose ops have rules
// too), forward and backward against one device in float64 on meshes (2),
// (4) and (2,2); the fused kernel runs with no collective when the inputs
// are sharded alike, uneven batch shards included.
#include "mesh_test.h"
#include "parity.h"

#include "comm/compat.h"
#include "dtp/comm_counter.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdio>

using namespace dtp;
using dtp::test::data;
using dtp::test::expect_parity;
using V = std::vector<at::Tensor>;

namespace {

using Sdpa = dtp::test::MeshTest;

TEST_P(Sdpa, FusedAttentionEqualsOneDevice) {
#if !DTP_HAS_SDPA
  GTEST_SKIP() << "at::scaled_dot_product_attention's fused CPU kernel is libtorch >= 2.2's (DTP_HAS_SDPA)";
#else
  run([&](const DeviceMesh& mesh, int64_t) {
    const int64_t B = 3, H = 5, L = 6, S = 6, E = 4;
    const at::Tensor q = data({B, H, L, E}, 0.1), k = data({B, H, S, E}, 0.2), v = data({B, H, S, E}, 0.3);
    const at::Tensor keep = data({L, S}, 0.4) > -0.6;  // bool: true attends
    const at::Tensor bias = data({B, H, L, S}, 0.5) * 0.3;
    for (auto p : {Shard(0), Shard(1), Replicate()}) {
      SCOPED_TRACE(p.str());
      const Placements pl = on(mesh, p);
      expect_parity(mesh, {q, k, v}, {pl, pl, pl}, [](const V& t) {
        return at::scaled_dot_product_attention(t[0], t[1], t[2], {}, 0.0, /*is_causal=*/true);
      });
      expect_parity(mesh, {q, k, v, keep}, {pl, pl, pl, on(mesh, Replicate())}, [](const V& t) {
        return at::scaled_dot_product_attention(t[0], t[1], t[2], t[3]);
      });
      expect_parity(mesh, {q, k, v, bias}, {pl, pl, pl, pl}, [](const V& t) {
        return at::scaled_dot_product_attention(t[0], t[1], t[2], t[3], 0.0, false, /*scale=*/0.7);
      });
      // Sharded alike: the forward and backward are local.
      at::Tensor dq = distribute_tensor(q.clone().requires_grad_(), mesh, pl);
      const at::Tensor dk = distribute_tensor(k, mesh, pl), dv = distribute_tensor(v, mesh, pl);
      const at::Tensor grad = distribute_tensor(data(q.sizes().vec(), 0.9), mesh, pl);
      CommCounter comm;
      at::Tensor out = at::scaled_dot_product_attention(dq, dk, dv, {}, 0.0, true);
      EXPECT_EQ(placements(out), pl);
      torch::autograd::backward({out}, {grad});
      EXPECT_EQ(comm.total_count(), 0) << comm.str();
      // The fused kernel computes each batch entry and head on its own: a
      // shard's result is one device's, up to rounding (printed).
      const double diff =
          (full_tensor(out.detach()) - at::scaled_dot_product_attention(q, k, v, {}, 0.0, true)).abs().max().item<double>();
      EXPECT_LE(diff, 1e-12);
      if (mesh.get_rank() == 0) std::printf("sdpa %s: max |dtp - one device| %.3g (float64)\n", p.str().c_str(), diff);
    }
  });
#endif
}

INSTANTIATE_TEST_SUITE_P(Meshes, Sdpa, dtp::test::mesh_shapes(), dtp::test::mesh_name);

}  // namespace
