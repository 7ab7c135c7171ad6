// Every rule family against a single device, forward and backward, on 1-D
// meshes of 2 and 4 ranks and a (2,2) mesh, with even and uneven shapes.
#include "close.h"
#include "mesh_test.h"
#include "parity.h"

#include "dtp/comm_counter.h"

using namespace dtp;
using dtp::test::data;
using dtp::test::expect_parity;
using dtp::test::run_ranks;
using V = std::vector<at::Tensor>;

namespace {

// Mesh shapes: (2), (4), (2,2).
class OpsTest : public dtp::test::MeshTest {};

std::vector<int64_t> rowCounts(int64_t w) { return {4 * w, 4 * w + 1, 4 * w + 3, w - 1}; }

TEST_P(OpsTest, PointwiseBinaryWithBroadcasting) {
  run([&](const DeviceMesh& mesh, int64_t w) {
    for (int64_t rows : rowCounts(w)) {
      at::Tensor x = data({rows, 6}), b = data({6}, 1.0), y = data({rows, 6}, 2.0);
      for (auto px : {Shard(0), Shard(1), Replicate()}) {
        SCOPED_TRACE(px.str() + " rows " + std::to_string(rows));
        expect_parity(mesh, {x, b}, {on(mesh, px), on(mesh, Replicate())},
                      [](const V& v) { return v[0] + v[1]; });
        expect_parity(mesh, {x, y}, {on(mesh, px), on(mesh, Shard(0))},
                      [](const V& v) { return v[0] * v[1] - v[1] / (v[0].abs() + 1); });
        expect_parity(mesh, {x}, {on(mesh, px)},
                      [](const V& v) { return at::silu(v[0]).exp() + at::relu(v[0]) * 2; });
      }
    }
  });
}

TEST_P(OpsTest, PartialInputsStayPartialThroughLinearOps) {
  run([&](const DeviceMesh& mesh, int64_t w) {
    at::Tensor a = data({5, 3}), b = data({5, 3}, 1.0);
    // mm with the contraction dim sharded gives P(sum); adding another
    // partial and scaling keeps it partial: no collective until the end.
    at::Tensor k1 = data({5, 2 * w}), k2 = data({2 * w, 3});
    at::Tensor m1 = distribute_tensor(k1, mesh, on(mesh, Shard(1)));
    at::Tensor m2 = distribute_tensor(k2, mesh, on(mesh, Shard(0)));
    CommCounter comm;
    at::Tensor p = at::mm(m1, m2);
    EXPECT_EQ(placements(p).back(), Partial());
    at::Tensor q = (p + p) * 0.5 - p / 4;
    EXPECT_EQ(placements(q).back(), Partial());
    EXPECT_EQ(comm.total_count(), 0);
    at::Tensor full = full_tensor(q);
    EXPECT_EQ(comm.count(CollectiveType::AllReduce), 1);
    at::Tensor ref = at::mm(k1, k2);
    EXPECT_CLOSE(full, ref * 0.75, 1e-5, 1e-8);
    // A nonlinear op must reduce first.
    EXPECT_CLOSE(full_tensor(at::exp(p)), at::exp(ref), 1e-5, 1e-8);
    (void)a;
    (void)b;
  });
}

// masked_fill with 0 keeps a Partial (linear); with any other value it must
// reduce first. The same op with the same specs, so the propagation cache
// must tell the two scalars apart. masked_select / masked_scatter and gather
// (cross_entropy's label smoothing) on replicated and partial inputs.
TEST_P(OpsTest, MaskingOpsKeepPartialsOnlyWhereLinear) {
  run([&](const DeviceMesh& mesh, int64_t w) {
    at::Tensor k1 = data({5, 2 * w}), k2 = data({2 * w, 3}, 1.0);
    at::Tensor mask = data({5, 3}, 2.0) > 0;
    at::Tensor m1 = distribute_tensor(k1, mesh, on(mesh, Shard(1)));
    at::Tensor m2 = distribute_tensor(k2, mesh, on(mesh, Shard(0)));
    at::Tensor dmask = distribute_tensor(mask, mesh, on(mesh, Replicate()));
    // Gloo has no bool: masks travel as bytes (broadcast above, all_gather here).
    EXPECT_TRUE(full_tensor(distribute_tensor(mask, mesh, on(mesh, Shard(0)))).equal(mask));
    const at::Tensor ref = at::mm(k1, k2);
    for (int rep = 0; rep < 2; ++rep) {  // the second round hits the cache
      for (double value : {0.0, 1.5}) {
        SCOPED_TRACE("value " + std::to_string(value));
        at::Tensor p = at::mm(m1, m2);
        CommCounter comm;
        at::Tensor f = p.masked_fill(dmask, value);
        EXPECT_EQ(placements(f).back().is_partial(), value == 0.0) << to_string(placements(f));
        EXPECT_EQ(comm.total_count(), value == 0.0 ? 0 : 1) << comm.str();
        EXPECT_CLOSE(full_tensor(f), ref.masked_fill(mask, value), 1e-12, 1e-12);
      }
    }
    at::Tensor p = at::mm(m1, m2);
    CommCounter comm;
    at::Tensor sel = at::masked_select(p, dmask);
    EXPECT_EQ(placements(sel).back(), Partial());
    EXPECT_EQ(comm.total_count(), 0) << comm.str();
    EXPECT_CLOSE(full_tensor(sel), ref.masked_select(mask), 1e-12, 1e-12);
    at::Tensor x = data({5, 3}, 3.0);
    expect_parity(mesh, {x, mask}, {on(mesh, Replicate()), on(mesh, Replicate())},
                  [](const V& v) { return at::masked_select(v[0], v[1]) * 2; });
    at::Tensor index = at::remainder(at::arange(4 * w + 1, at::kLong) * 7, 5);
    for (auto pi : {Shard(0), Replicate()}) {
      expect_parity(mesh, {data({5}, 4.0), index}, {on(mesh, Replicate()), on(mesh, pi)},
                    [](const V& v) { return at::gather(v[0], 0, v[1]); });
    }
  });
}

TEST_P(OpsTest, MatmulEveryPlacementPair) {
  run([&](const DeviceMesh& mesh, int64_t w) {
    for (int64_t m : {2 * w, 2 * w + 1, w - 1}) {
      at::Tensor a = data({m, 2 * w + 1}), b = data({2 * w + 1, w + 2}, 1.0);
      for (auto pa : {Shard(0), Shard(1), Replicate()})
        for (auto pb : {Shard(0), Shard(1), Replicate()}) {
          SCOPED_TRACE(pa.str() + "," + pb.str() + " m " + std::to_string(m));
          expect_parity(mesh, {a, b}, {on(mesh, pa), on(mesh, pb)},
                        [](const V& v) { return at::mm(v[0], v[1]); });
        }
    }
  });
}

TEST_P(OpsTest, LinearAndBatchedMatmul) {
  run([&](const DeviceMesh& mesh, int64_t w) {
    at::Tensor x = data({2, 3 * w + 1, 8}), wt = data({4 * w, 8}, 1.0), bias = data({4 * w}, 2.0);
    for (auto pw : {Shard(0), Shard(1), Replicate()})
      for (auto px : {Shard(0), Shard(1), Shard(2), Replicate()}) {
        SCOPED_TRACE(pw.str() + " x " + px.str());
        Placement pb = pw.is_shard(0) ? Shard(0) : Replicate();
        expect_parity(mesh, {x, wt, bias}, {on(mesh, px), on(mesh, pw), on(mesh, pb)},
                      [](const V& v) { return at::linear(v[0], v[1], v[2]); });
      }
    at::Tensor q = data({3, 2 * w + 1, 5}), k = data({3, 5, w + 1}, 1.0);
    for (auto pq : {Shard(0), Shard(1), Shard(2), Replicate()}) {
      expect_parity(mesh, {q, k}, {on(mesh, pq), on(mesh, Shard(0))},
                    [](const V& v) { return at::matmul(v[0], v[1]); });
    }
  });
}

TEST_P(OpsTest, ViewsAndShapeOps) {
  run([&](const DeviceMesh& mesh, int64_t w) {
    for (int64_t rows : {4 * w, 4 * w + 1, w - 1}) {
      at::Tensor x = data({rows, 2 * w, 3});
      for (auto px : {Shard(0), Shard(1), Shard(2), Replicate()}) {
        SCOPED_TRACE(px.str() + " rows " + std::to_string(rows));
        auto pl = std::vector<Placements>{on(mesh, px)};
        expect_parity(mesh, {x}, pl, [](const V& v) { return v[0].transpose(0, 1) * 2; });
        expect_parity(mesh, {x}, pl, [](const V& v) { return v[0].permute({2, 0, 1}).contiguous(); });
        expect_parity(mesh, {x}, pl, [&](const V& v) { return v[0].reshape({rows, 2 * w * 3}); });
        expect_parity(mesh, {x}, pl, [&](const V& v) { return v[0].view({rows, w, 2, 3}) + 1; });
        expect_parity(mesh, {x}, pl, [](const V& v) { return v[0].flatten(0, 1); });
        expect_parity(mesh, {x}, pl, [](const V& v) { return v[0].unsqueeze(1).expand({-1, 4, -1, -1}); });
        expect_parity(mesh, {x}, pl, [](const V& v) { return v[0].narrow(2, 1, 2); });
        expect_parity(mesh, {x}, pl, [](const V& v) { return v[0].select(2, 1); });
        expect_parity(mesh, {x}, pl, [](const V& v) {
          auto parts = v[0].split(1, 2);
          return at::cat({parts[2], parts[0], parts[1]}, 2);
        });
        expect_parity(mesh, {x}, pl, [](const V& v) { return at::stack({v[0], v[0] * 2}, 1); });
        expect_parity(mesh, {x}, pl, [](const V& v) { return v[0].select(1, 0).t() * 3; });
      }
    }
  });
}

TEST_P(OpsTest, ReductionsAndSoftmax) {
  run([&](const DeviceMesh& mesh, int64_t w) {
    for (int64_t rows : rowCounts(w)) {
      at::Tensor x = data({rows, 2 * w + 1});
      for (auto px : {Shard(0), Shard(1), Replicate()}) {
        SCOPED_TRACE(px.str() + " rows " + std::to_string(rows));
        auto pl = std::vector<Placements>{on(mesh, px)};
        expect_parity(mesh, {x}, pl, [](const V& v) { return v[0].sum(); });
        expect_parity(mesh, {x}, pl, [](const V& v) { return v[0].sum(0); });
        expect_parity(mesh, {x}, pl, [](const V& v) { return v[0].sum({1}, true); });
        expect_parity(mesh, {x}, pl, [](const V& v) { return v[0].mean(); });
        expect_parity(mesh, {x}, pl, [](const V& v) { return v[0].mean(1); });
        expect_parity(mesh, {x}, pl, [](const V& v) { return v[0].amax(0); });
        expect_parity(mesh, {x}, pl, [](const V& v) { return at::softmax(v[0], 1); });
        expect_parity(mesh, {x}, pl, [](const V& v) { return at::log_softmax(v[0], 0); });
        expect_parity(mesh, {x}, pl, [](const V& v) { return v[0].norm(); });
      }
    }
  });
}

TEST_P(OpsTest, LayerNormAndEmbedding) {
  run([&](const DeviceMesh& mesh, int64_t w) {
    at::Tensor x = data({3, 2 * w + 1, 8}), g = data({8}, 1.0) + 1, b = data({8}, 2.0);
    for (auto px : {Shard(0), Shard(1), Shard(2), Replicate()}) {
      expect_parity(mesh, {x, g, b}, {on(mesh, px), on(mesh, Replicate()), on(mesh, Replicate())},
                    [](const V& v) { return at::layer_norm(v[0], {8}, v[1], v[2]); });
    }
    const int64_t vocab = 4 * w + 1;
    at::Tensor table = data({vocab, 6});
    at::Tensor idx = at::remainder(at::arange(2 * 5, at::kLong) * 7, vocab).view({2, 5});
    for (auto pt : {Shard(0), Shard(1), Replicate()})
      for (auto pi : {Shard(0), Shard(1), Replicate()}) {
        SCOPED_TRACE("table " + pt.str() + " idx " + pi.str());
        expect_parity(mesh, {table, idx}, {on(mesh, pt), on(mesh, pi)},
                      [](const V& v) { return at::embedding(v[0], v[1]); });
      }
  });
}

TEST_P(OpsTest, FullNormMovesOneScalarPerShardedMeshDim) {
  run([&](const DeviceMesh& mesh, int64_t w) {
    at::Tensor full = data({4 * w + 3, 5});
    for (double p : {2.0, 1.0, 3.0, static_cast<double>(INFINITY)}) {
      at::Tensor x = distribute_tensor(full, mesh, on(mesh, Shard(0), Shard(1)));
      CommCounter comm;
      at::Tensor n = at::linalg_vector_norm(x, p);
      EXPECT_EQ(comm.count(CollectiveType::AllReduce), mesh.ndim());
      EXPECT_EQ(comm.count(CollectiveType::AllGather), 0);
      EXPECT_NEAR(full_tensor(n).item<double>(), at::linalg_vector_norm(full, p).item<double>(), 1e-9);
    }
    expect_parity(mesh, {full}, {on(mesh, Shard(0))}, [](const V& v) { return v[0].norm(); });
  });
}

TEST_P(OpsTest, CrossEntropyOnBatchShardedLogits) {
  run([&](const DeviceMesh& mesh, int64_t w) {
    const int64_t n = 4 * w + 1, classes = 7;
    at::Tensor logits = data({n, classes});
    at::Tensor target = at::remainder(at::arange(n, at::kLong) * 3, classes);
    target[1] = -100;  // ignored
    for (auto pl : {Shard(0), Replicate()}) {
      for (int64_t reduction : {0, 1, 2}) {
        SCOPED_TRACE(pl.str() + " reduction " + std::to_string(reduction));
        expect_parity(mesh, {logits, target}, {on(mesh, pl), on(mesh, pl)}, [&](const V& v) {
          return at::nll_loss(at::log_softmax(v[0], 1), v[1], {}, reduction, -100);
        });
      }
    }
  });
}

TEST_P(OpsTest, InPlaceAndOutOpsReturnTheDTensor) {
  run([&](const DeviceMesh& mesh, int64_t w) {
    at::Tensor full = data({2 * w + 1, 3});
    at::Tensor x = distribute_tensor(full, mesh, on(mesh, Shard(0)));
    at::Tensor y = distribute_tensor(full * 2, mesh, on(mesh, Replicate()));
    at::Tensor& r = x.mul_(3).add_(y);
    EXPECT_TRUE(r.is_same(x));
    EXPECT_EQ(placements(x), on(mesh, Shard(0)));
    EXPECT_CLOSE(full_tensor(x), full * 5, 1e-5, 1e-8);
    at::Tensor z = at::zeros_like(x);
    at::mul_out(z, x, y);
    EXPECT_CLOSE(full_tensor(z), full * full * 10, 1e-5, 1e-8);
    z.copy_(y);
    EXPECT_EQ(placements(z), on(mesh, Shard(0)));
    EXPECT_CLOSE(full_tensor(z), full * 2, 1e-5, 1e-8);
    EXPECT_NEAR(x.sum().item<double>(), (full * 5).sum().item<double>(), 1e-9);
  });
}

// On a one-rank mesh dim every placement holds the whole tensor: ops keep
// their inputs' placements instead of trading them for free (a (1, 2) mesh
// keeps S(0) on dim 0 as the 2-rank dim needs no change either).
TEST(OpsOneRankDimTest, PlacementsStay) {
  run_ranks(2, [&](int) {
    for (const auto& shape : {std::vector<int64_t>{1, 2}, std::vector<int64_t>{2, 1}}) {
      auto mesh = init_device_mesh("cpu", shape);
      const at::Tensor full = data({4, 6}).to(at::kFloat);
      const Placements pl{Shard(0), Shard(1)};
      at::Tensor a = distribute_tensor(full, mesh, pl), b = distribute_tensor(full * 2, mesh, pl);
      CommCounter comm;
      at::Tensor c = a + b;
      EXPECT_EQ(placements(c), pl);
      a.mul_(b);
      EXPECT_EQ(comm.total_count(), 0) << comm.str();
      EXPECT_CLOSE(full_tensor(c), full * 3, 1e-5, 1e-8);
      EXPECT_CLOSE(full_tensor(a), full * full * 2, 1e-5, 1e-8);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, OpsTest, dtp::test::mesh_shapes(), dtp::test::mesh_name);

}  // namespace
