// The op families ordinary model and inference code reaches for (#26):
// comparisons of two tensors, where with a scalar, max/min with a dim,
// argmax/argmin, var/std with a correction, cumsum/cumprod, sort, topk and
// flip, against one device in float64 on meshes (2), (4) and (2,2), every
// placement of the input (uneven and empty shards included), forward and,
// where the op is differentiable and its backward's ops have rules, backward.
// A shard on the dim an op works along is gathered first (the rules say so);
// any other stays, which the output placements show.
#include "mesh_test.h"
#include "parity.h"

#include "dtp/comm_counter.h"

using namespace dtp;
using dtp::test::data;
using dtp::test::expect_parity;
using dtp::test::run_ranks;
using V = std::vector<at::Tensor>;

namespace {

class OpFamilies : public dtp::test::MeshTest {
 protected:
  // Rows: even, uneven, and fewer rows than ranks (an empty shard).
  static std::vector<int64_t> rowCounts(int64_t w) { return {2 * w, 2 * w + 1, w - 1}; }
};

TEST_P(OpFamilies, ComparisonsAndWhere) {
  run([&](const DeviceMesh& mesh, int64_t w) {
    for (int64_t rows : rowCounts(w)) {
      const at::Tensor x = data({rows, 5}), y = data({rows, 5}, 0.3), b = data({5}, 0.7);
      for (auto px : {Shard(0), Shard(1), Replicate()}) {
        SCOPED_TRACE(px.str() + " rows " + std::to_string(rows));
        const std::vector<Placements> two{on(mesh, px), on(mesh, Shard(0))}, bcast{on(mesh, px), on(mesh, Replicate())};
        expect_parity(mesh, {x, y}, two, [](const V& v) {
          return (v[0] > v[1]).to(at::kDouble) + (v[0] < v[1]).to(at::kDouble) * 2 + (v[0] >= v[1]).to(at::kDouble) * 4 +
                 (v[0] <= v[1]).to(at::kDouble) * 8 + (v[0] != v[1]).to(at::kDouble) * 16;
        }, /*backward=*/false);
        expect_parity(mesh, {x, b}, bcast, [](const V& v) {
          return at::logical_or(v[0] > v[1], v[0] < -0.5).to(at::kDouble) +
                 at::logical_xor(v[0] > 0, v[1] > 0).to(at::kDouble) * 2;
        }, /*backward=*/false);
        // where with a scalar on either side, and clamp between tensors: backward too.
        expect_parity(mesh, {x, y}, two, [](const V& v) {
          return at::where(v[0] > v[1], v[0], 0.25) + at::where(v[1] > 0, -1.5, v[1]) + at::clamp(v[0], v[1] - 0.5, v[1] + 0.5);
        });
      }
    }
  });
}

TEST_P(OpFamilies, ReductionsWithIndicesAndCorrection) {
  run([&](const DeviceMesh& mesh, int64_t w) {
    for (int64_t rows : rowCounts(w)) {
      const at::Tensor x = data({rows, 2 * w + 1}).mul(3).sin();
      for (auto px : {Shard(0), Shard(1), Replicate()}) {
        SCOPED_TRACE(px.str() + " rows " + std::to_string(rows));
        const std::vector<Placements> pl{on(mesh, px)};
        // Reduced along dim 1: rows with no elements along it cannot reduce, so only rows > 0.
        expect_parity(mesh, {x}, pl, [](const V& v) {
          auto [val, idx] = v[0].max(1);
          auto [lo, lo_idx] = v[0].min(1, /*keepdim=*/true);
          return val + idx.to(at::kDouble) + lo.squeeze(1) * 2 + lo_idx.squeeze(1).to(at::kDouble) * 3;
        }, /*backward=*/false);
        expect_parity(mesh, {x}, pl, [](const V& v) {
          return v[0].argmax(1).to(at::kDouble) + v[0].argmin(1).to(at::kDouble) * 10;
        }, false);
        if (rows > 1) {
          expect_parity(mesh, {x}, pl, [](const V& v) { return v[0].argmax(0).to(at::kDouble) - v[0].argmin(0).to(at::kDouble); },
                        false);
          expect_parity(mesh, {x}, pl, [](const V& v) { return at::var(v[0], {0}, /*unbiased=*/true); });
        }
        expect_parity(mesh, {x}, pl, [](const V& v) { return at::var(v[0], {1}, /*unbiased=*/false, /*keepdim=*/true); });
        expect_parity(mesh, {x}, pl, [](const V& v) { return at::std(v[0], {1}, /*unbiased=*/true) + v[0].argmax().to(at::kDouble); });
        expect_parity(mesh, {x}, pl, [](const V& v) {
          auto [var, mean] = at::var_mean(v[0], {1}, /*unbiased=*/true);
          auto [sd, mean2] = at::std_mean(v[0], {1}, /*unbiased=*/false, /*keepdim=*/true);
          return var + mean * 2 + sd.squeeze(1) * 3 + mean2.squeeze(1) * 4;
        });
      }
    }
  });
}

TEST_P(OpFamilies, AlongADim) {
  run([&](const DeviceMesh& mesh, int64_t w) {
    for (int64_t rows : rowCounts(w)) {
      const at::Tensor x = data({rows, 2 * w + 1}).mul(5).cos();
      for (auto px : {Shard(0), Shard(1), Replicate()}) {
        SCOPED_TRACE(px.str() + " rows " + std::to_string(rows));
        const std::vector<Placements> pl{on(mesh, px)};
        expect_parity(mesh, {x}, pl, [](const V& v) { return v[0].cumsum(1) + v[0].cumsum(0) * 2; });
        expect_parity(mesh, {x}, pl, [](const V& v) { return v[0].add(2).cumprod(1); }, /*backward=*/false);
        expect_parity(mesh, {x}, pl, [](const V& v) { return v[0].flip({0}) + v[0].flip({1}) * 3; });
        expect_parity(mesh, {x}, pl, [](const V& v) {
          auto [val, idx] = v[0].sort(1, /*descending=*/true);
          return val + idx.to(at::kDouble) * 10;
        }, false);
        expect_parity(mesh, {x}, pl, [](const V& v) {
          auto [val, idx] = at::sort(v[0], /*stable=*/true, 0);
          return val - idx.to(at::kDouble);
        }, false);
        const int64_t k = std::min<int64_t>(2, 2 * w + 1);
        expect_parity(mesh, {x}, pl, [k](const V& v) {
          auto [val, idx] = v[0].topk(k, 1);
          return val + idx.to(at::kDouble) * 100;
        }, false);
      }
    }
  });
}

// index_select with a replicated index (self sharded on either dim) or a
// sharded index (self replicated), forward and backward (index_add).
// In-place view ops change the DTensor's shape and placements where it
// stands; matmul of a vector by a matrix ends in squeeze_ (forward and
// gradients against one device).
TEST_P(OpFamilies, InPlaceViews) {
  run([&](const DeviceMesh& mesh, int64_t) {
    const at::Tensor x = data({5, 1, 7});
    at::Tensor d = distribute_tensor(x, mesh, on(mesh, Shard(2)));
    at::Tensor* const same = &d;
    d.squeeze_(1);
    EXPECT_EQ(d.sizes(), (std::vector<int64_t>{5, 7}));
    EXPECT_EQ(placements(d), on(mesh, Shard(1)));
    d.unsqueeze_(0);
    EXPECT_EQ(placements(d), on(mesh, Shard(2)));
    d.squeeze_();
    d.t_();
    EXPECT_EQ(placements(d), on(mesh, Shard(0)));
    d.transpose_(0, 1);
    EXPECT_EQ(same, &d);
    EXPECT_TRUE(full_tensor(d).equal(x.squeeze(1)));
    // A sharded size-1 dim cannot be squeezed in place without moving data.
    at::Tensor ones = distribute_tensor(x, mesh, on(mesh, Shard(1)));
    dtp::test::expect_error([&] { ones.squeeze_(1); }, "would move its data");
    for (auto p : {Shard(0), Shard(1), Replicate()}) {
      SCOPED_TRACE(p.str());
      expect_parity(mesh, {data({7}, 0.2), data({7, 3}, 0.4)}, {on(mesh, Replicate()), on(mesh, p)},
                    [](const V& t) { return at::matmul(t[0], t[1]); });
    }
  });
}

TEST_P(OpFamilies, IndexSelect) {
  run([&](const DeviceMesh& mesh, int64_t w) {
    for (int64_t rows : rowCounts(w)) {
      const at::Tensor x = data({rows + 2, 2 * w + 1});
      const at::Tensor index = at::remainder(at::arange(2 * w + 1, at::kLong) * 3, rows + 2);
      for (auto px : {Shard(0), Shard(1), Replicate()})
        for (auto pi : {Replicate(), Shard(0)}) {
          SCOPED_TRACE(px.str() + " index " + pi.str() + " rows " + std::to_string(rows));
          expect_parity(mesh, {x, index}, {on(mesh, px), on(mesh, pi)},
                        [](const V& v) { return v[0].index_select(0, v[1]) * 2; });
          const at::Tensor cols = at::remainder(index, 2 * w + 1);
          expect_parity(mesh, {x, cols}, {on(mesh, px), on(mesh, pi)},
                        [](const V& v) { return v[0].index_select(1, v[1]).sin(); });
        }
    }
  });
}

// A shard on a kept dim stays sharded, with no collective.
TEST_P(OpFamilies, ShardsOnOtherDimsMoveNothing) {
  run([&](const DeviceMesh& mesh, int64_t w) {
    const at::Tensor x = data({4 * w, 6});
    at::Tensor d = distribute_tensor(x, mesh, on(mesh, Shard(0)));
    CommCounter comm;
    auto [val, idx] = d.max(1);
    at::Tensor s = d.cumsum(1), t = std::get<0>(d.topk(2, 1)), v = at::var(d, {1}, true), c = (d > d.flip({1}));
    EXPECT_EQ(comm.total_count(), 0);
    for (const at::Tensor& out : {val, idx, s, t, v, c}) EXPECT_EQ(placements(out), on(mesh, Shard(0)));
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, OpFamilies, dtp::test::mesh_shapes(), dtp::test::mesh_name);

}  // namespace
