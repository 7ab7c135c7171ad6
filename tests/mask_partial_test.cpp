// MaskPartial (NOTE: [MaskPartial]): the vocabulary-sharded embedding's
// output, a Partial(sum) whose spec carries the mask of the positions that
// are other ranks'. Equality, printing and cache keys; reductions to R, S
// and P equal to one device in float64 with the collectives counted, on
// uneven vocabularies (an empty shard included) and a (2,2) mesh; the
// backward computing only this rank's rows; errors.
#include "close.h"
#include "dist.h"
#include "parity.h"
#include "rule_golden.h"

#include "dtensor/redistribute_plan.h"
#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace dtp::test {
namespace {

TEST(MaskPartialTest, EqualityPrintingAndKeys) {
  EXPECT_EQ(MaskPartial(10), MaskPartial(10, 0));
  EXPECT_NE(MaskPartial(10), MaskPartial(9));
  EXPECT_NE(MaskPartial(10), MaskPartial(10, 1));
  EXPECT_NE(MaskPartial(10), Partial());
  EXPECT_NE(Partial(), MaskPartial(10));
  EXPECT_FALSE(MaskPartial(10).is_partial());
  EXPECT_TRUE(MaskPartial(10).is_mask_partial());
  EXPECT_EQ(MaskPartial(10).str(), "MaskP(0,10)");
  EXPECT_NE(MaskPartial(10).hash(), Partial().hash());
  EXPECT_NE(MaskPartial(10).hash(), MaskPartial(9).hash());
  // Plan and decision caches key on placement_key: distinct for each.
  const std::vector<Placement> all{Replicate(), Shard(0),       Shard(1),         Partial(),
                                   Partial(ReduceOp::Avg), MaskPartial(9), MaskPartial(10), MaskPartial(10, 1)};
  for (size_t i = 0; i < all.size(); ++i)
    for (size_t j = i + 1; j < all.size(); ++j)
      EXPECT_NE(placement_key(all[i]), placement_key(all[j])) << all[i] << " " << all[j];
  // The golden parser reads what the spec prints.
  RuleGolden g({2});
  at::Tensor t = g.t("f32[2,3,4](MaskP(0,10))");
  EXPECT_EQ(dtensor_spec(t).str(), "f32[2,3,4](MaskP(0,10))");
  EXPECT_TRUE(dtensor_spec(t).has_partial());
  EXPECT_EQ(g.propagate("aten::embedding_dense_backward", {g.t("f32[2,3,4](MaskP(0,10))"), g.t("i64[2,3](R)"), 10,
                                                           -1, false}),
            "MaskP(0,10), R -> f32[10,4](S(0))");
  // A Partial gradient is not a MaskPartial one: PyTorch's [V, D] Partial.
  EXPECT_EQ(g.propagate("aten::embedding_dense_backward", {g.t("f32[2,3,4](P(sum))"), g.t("i64[2,3](R)"), 10, -1,
                                                           false}),
            "P(sum), R -> f32[10,4](P(sum))");
}

// Vocabularies 4w, 4w+1 and one leaving the last rank empty (w=2: 1 -> 1,0;
// w=4: 9 -> 3,3,3,0), looked up by replicated ids: the lookup moves nothing;
// MaskP -> R is one all_reduce, -> S(0) one reduce_scatter, -> P none; each
// equals one device exactly (one rank's row plus zeros). The backward moves
// nothing, its gradient is MaskPartial, and the weight's gradient is S(0),
// computed on this rank's rows only (its local storage is rows + 1 rows,
// the spare row of other ranks' ids, not V).
TEST(MaskPartialTest, LookupReducesLikeOneDeviceOnUnevenVocabularies) {
  for (int w : {2, 4}) {
    run_ranks(w, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {w});
      for (int64_t vocab : {int64_t{4} * w, int64_t{4} * w + 1, w == 2 ? int64_t{1} : int64_t{9}}) {
        SCOPED_TRACE(c10::str(w, " ranks, vocabulary ", vocab));
        const int64_t dim = 5, rows = chunk_size(vocab, w, rank);
        const at::Tensor weight = data({vocab, dim}), g = data({3, 4, dim}, 0.3);
        const at::Tensor ids = at::remainder(at::arange(12, at::kLong) * 5, vocab).view({3, 4});
        at::Tensor rw = weight.clone().requires_grad_(true);
        const at::Tensor ry = at::embedding(rw, ids);
        (ry * g).sum().backward();

        at::Tensor dw = distribute_tensor(weight.clone().requires_grad_(true), mesh, {Shard(0)});
        const at::Tensor dids = distribute_tensor(ids, mesh, {Replicate()});
        CommCounter fwd;
        at::Tensor y = at::embedding(dw, dids);
        EXPECT_EQ(fwd.total_count(), 0) << fwd.str();
        ASSERT_EQ(placements(y), Placements{MaskPartial(vocab)});
        at::Tensor grad_of_y;
        y.register_hook([&](const at::Tensor& gy) { grad_of_y = gy; });

        CommCounter to_s;
        at::Tensor ys = redistribute(y, mesh, {Shard(0)});
        EXPECT_EQ(to_s.count(CollectiveType::ReduceScatter), 1) << to_s.str();
        EXPECT_EQ(to_s.total_count(), 1) << to_s.str();
        CommCounter to_p;
        at::Tensor yp = redistribute(y, mesh, {Partial()});
        EXPECT_EQ(to_p.total_count(), 0) << to_p.str();
        CommCounter to_r;
        at::Tensor yr = redistribute(y, mesh, {Replicate()});
        EXPECT_EQ(to_r.count(CollectiveType::AllReduce), 1) << to_r.str();
        EXPECT_EQ(to_r.total_count(), 1) << to_r.str();
        EXPECT_CLOSE(to_local(yr), ry, 0.0, 0.0);
        EXPECT_CLOSE(full_tensor(ys), ry, 0.0, 0.0);
        EXPECT_CLOSE(full_tensor(yp), ry, 0.0, 0.0);

        const at::Tensor dg = distribute_tensor(g, mesh, {Replicate()});
        CommCounter bwd;
        (yr * dg).sum().backward();
        EXPECT_EQ(bwd.total_count(), 0) << bwd.str();
        ASSERT_TRUE(grad_of_y.defined());
        EXPECT_EQ(placements(grad_of_y), Placements{MaskPartial(vocab)});
        EXPECT_EQ(placements(dw.grad()), Placements{Shard(0)});
        // Sums of the same products in the same order as one device's kernel.
        EXPECT_CLOSE(full_tensor(dw.grad()), rw.grad(), 0.0, 1e-15);

        // The op alone, on the MaskPartial gradient: local rows, S(0), no
        // communication, O(V / w) storage. On a replicated gradient it is
        // PyTorch's rule: the whole [V, D] on every rank.
        CommCounter op;
        at::Tensor dgw = at::embedding_dense_backward(grad_of_y, dids, vocab, -1, false);
        EXPECT_EQ(op.total_count(), 0) << op.str();
        EXPECT_EQ(placements(dgw), Placements{Shard(0)});
        EXPECT_EQ(to_local(dgw).sizes(), (c10::IntArrayRef{rows, dim}));
        EXPECT_EQ(to_local(dgw).storage().nbytes(), static_cast<size_t>((rows + 1) * dim * 8));
        EXPECT_CLOSE(full_tensor(dgw), rw.grad(), 0.0, 1e-15);
        at::Tensor dgr = at::embedding_dense_backward(redistribute(grad_of_y, mesh, {Replicate()}), dids, vocab, -1,
                                                      false);
        EXPECT_EQ(placements(dgr), Placements{Replicate()});
        EXPECT_EQ(to_local(dgr).sizes(), (c10::IntArrayRef{vocab, dim}));
      }
    });
  }
}

// A decision or plan cached for a Partial input must not serve a
// MaskPartial one (whose shard holds other ranks' positions unmasked), and
// the other way round: mul by a scalar on each, in both orders.
TEST(MaskPartialTest, CachedDecisionsKeepPartialAndMaskPartialApart) {
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    const int64_t vocab = 7;
    const at::Tensor weight = data({vocab, 3});
    const at::Tensor ids = at::remainder(at::arange(6, at::kLong) * 3, vocab).view({2, 3});
    const at::Tensor ref = at::embedding(weight, ids) * 2;
    for (bool mask_first : {true, false}) {
      for (int k = 0; k < 2; ++k) {
        const bool mask = (k == 0) == mask_first;
        SCOPED_TRACE(mask ? "MaskPartial" : "Partial");
        at::Tensor y = at::embedding(distribute_tensor(weight, mesh, {Shard(0)}), distribute_tensor(ids, mesh, {Replicate()}));
        if (!mask) y = redistribute(y, mesh, {Partial()});
        at::Tensor z = y * 2;
        EXPECT_EQ(placements(z), Placements{Partial()});
        EXPECT_CLOSE(full_tensor(z), ref, 0.0, 0.0);
      }
    }
  });
}

// (2,2) mesh: the vocabulary sharded on both dims (rows 2,2,2,1 of 7), ids
// replicated: MaskP on both, two all_reduces to R; and sharded on dim 1
// with the ids' batch on dim 0: S(0)MaskP, one all_reduce to S(0)R. The
// backward moves nothing but the data-parallel reduction of the gradient.
TEST(MaskPartialTest, TwoDimensionalMesh) {
  run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    const int64_t vocab = 7;
    const at::Tensor weight = data({vocab, 4}), g = data({4, 3, 4}, 0.5);
    const at::Tensor ids = at::remainder(at::arange(12, at::kLong) * 3, vocab).view({4, 3});
    at::Tensor rw = weight.clone().requires_grad_(true);
    (at::embedding(rw, ids) * g).sum().backward();
    struct Case {
      Placements weight, ids, out, reduced;
      int64_t fwd_all_reduces, bwd_all_reduces;
    };
    for (const Case& c : {Case{{Shard(0), Shard(0)}, {Replicate(), Replicate()},
                               {MaskPartial(vocab), MaskPartial(vocab)}, {Replicate(), Replicate()}, 2, 0},
                          Case{{Replicate(), Shard(0)}, {Shard(0), Replicate()}, {Shard(0), MaskPartial(vocab)},
                               {Shard(0), Replicate()}, 1, 1}}) {
      SCOPED_TRACE(to_string(c.weight) + " weight, " + to_string(c.ids) + " ids");
      at::Tensor dw = distribute_tensor(weight.clone().requires_grad_(true), mesh, c.weight);
      at::Tensor y = at::embedding(dw, distribute_tensor(ids, mesh, c.ids));
      ASSERT_EQ(placements(y), c.out);
      CommCounter fwd;
      at::Tensor yr = redistribute(y, mesh, c.reduced);
      EXPECT_EQ(fwd.count(CollectiveType::AllReduce), c.fwd_all_reduces) << fwd.str();
      EXPECT_EQ(fwd.total_count(), c.fwd_all_reduces) << fwd.str();
      EXPECT_CLOSE(full_tensor(yr), at::embedding(weight, ids), 0.0, 0.0);
      const at::Tensor dg = distribute_tensor(g, mesh, c.reduced);
      CommCounter bwd;
      (yr * dg).sum().backward();
      EXPECT_EQ(bwd.total_count(), c.bwd_all_reduces) << bwd.str();
      EXPECT_EQ(placements(dw.grad()), c.weight);
      EXPECT_CLOSE(full_tensor(dw.grad()), rw.grad(), 0.0, 1e-15);
    }
  });
}

TEST(MaskPartialTest, ErrorsNameTheFix) {
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    const at::Tensor t = data({3, 4});
    expect_error([&] { distribute_tensor(t, mesh, {MaskPartial(5)}); },
                 {"distribute_tensor: NYI: MaskP(0,5)", "Use Partial()"});
    expect_error([&] { from_local(t, mesh, {MaskPartial(5)}); }, {"from_local: NYI: MaskP(0,5)"});
    at::Tensor r = distribute_tensor(t, mesh, {Replicate()});
    expect_error([&] { redistribute(r, mesh, {MaskPartial(5)}); },
                 {"redistribute: NYI: R -> MaskP(0,5)", "only the op that makes a MaskPartial"});
    at::Tensor y = at::embedding(distribute_tensor(data({5, 4}), mesh, {Shard(0)}),
                                 distribute_tensor(at::arange(3, at::kLong), mesh, {Replicate()}));
    expect_error([&] { redistribute(y, mesh, {MaskPartial(6)}); }, {"NYI: P(sum) -> MaskP(0,6)"});
    EXPECT_EQ(redistribute(y, mesh, {MaskPartial(5)}).unsafeGetTensorImpl(), y.unsafeGetTensorImpl());
  });
}

}  // namespace
}  // namespace dtp::test
