// linear, matmul and dtp::nn::rms_norm on DTensors without autograd (NOTE: [Fused ops without
// autograd], src/dtensor/fused_ops.cpp): one DTensor op instead of the
// decomposition, equal to the decomposition bit for bit and to one device in
// float64, on meshes (2), (4) and (2,2); the decomposition wherever a graph is
// recorded, a checkpoint tape is active or the shapes are not the rule's.
// (The op sweep checks the values under every placement.)
#include "close.h"
#include "mesh_test.h"
#include "parity.h"

#include "comm/result_tape.h"
#include "dtensor/sharding_prop.h"
#include "dtp/explicit_redistribute.h"
#include "dtp/fused_ops.h"
#include "dtp/module_utils.h"
#include "dtp/nn/modules.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/autograd.h>

using namespace dtp;
using dtp::test::data;

namespace {

using FusedOps = dtp::test::MeshTest;

// DTensor ops through the fallback while `f` runs (each asks the propagator once).
int64_t dtensorOps(const std::function<void()>& f) {
  const auto before = propagation_cache_stats();
  f();
  const auto after = propagation_cache_stats();
  return (after.hits + after.misses) - (before.hits + before.misses);
}

TEST_P(FusedOps, OneDTensorOpWithoutAGraph) {
  run([&](const DeviceMesh& mesh, int64_t) {
    const at::Tensor x = data({2, 5, 7}, 0.1), w = data({3, 7}, 0.2), b = data({3}, 0.3);
    const at::Tensor ref_linear = at::linear(x, w, b), ref_matmul = at::matmul(x, w.t());
    for (auto px : {Shard(0), Shard(1), Shard(2), Replicate()}) {
      for (auto pw : {Shard(0), Shard(1), Replicate()}) {
        SCOPED_TRACE(px.str() + " x " + pw.str());
        const at::Tensor dx = distribute_tensor(x, mesh, on(mesh, px));
        const at::Tensor dw = distribute_tensor(w, mesh, on(mesh, pw));
        const at::Tensor dwt = distribute_tensor(w.t().contiguous(), mesh, on(mesh, pw));
        const at::Tensor db = distribute_tensor(b, mesh, on(mesh, pw.is_shard() && pw.dim == 0 ? pw : Replicate()));
        at::Tensor fused_linear, fused_matmul, decomposed_linear, decomposed_matmul;
        {
          at::NoGradGuard no_grad;
          EXPECT_EQ(dtensorOps([&] { fused_linear = at::linear(dx, dw, db); }), 1);
          EXPECT_EQ(dtensorOps([&] { fused_matmul = at::matmul(dx, dwt); }), 1);
        }
        // With a graph: a bias decomposes (several DTensor ops); a matmul
        // by a 2-D weight is fused where its placements have a plan
        // (NOTE: [Fused ops under autograd], FusedOps.ProductsUnderAutograd).
        const at::Tensor gx = distribute_tensor(x.clone().requires_grad_(), mesh, on(mesh, px));
        EXPECT_GT(dtensorOps([&] { decomposed_linear = at::linear(gx, dw, db); }), 1);
        const bool planned = (px.is_replicate() && !(pw.is_shard() && pw.dim == 0)) ||
                             (px.is_shard() && px.dim == 2 && pw.is_shard() && pw.dim == 0) ||
                             (px.is_shard() && px.dim < 2 && pw.is_replicate());
        const int64_t ops = dtensorOps([&] { decomposed_matmul = at::matmul(gx, dwt); });
        if (planned) EXPECT_EQ(ops, 0);
        else EXPECT_GT(ops, 1);
        EXPECT_CLOSE(full_tensor(fused_linear), ref_linear, 1e-12, 1e-12);
        EXPECT_CLOSE(full_tensor(fused_matmul), ref_matmul, 1e-12, 1e-12);
        // Where both keep the placements, the local ops are the same ones.
        if (placements(fused_matmul) == placements(decomposed_matmul))
          EXPECT_TRUE(to_local(fused_matmul).equal(to_local(decomposed_matmul).detach()));
      }
    }
  });
}

// Bias-free linear and matmul by a 2-D weight with a graph: no DTensor op
// where the placements have a plan (column-wise, row-wise, rows of x, all
// replicated), the decomposition elsewhere; values and gradients of x and
// the weight equal one device's and the decomposition's (explicit-
// redistribution mode turns the fused path off), on every mesh.
TEST_P(FusedOps, ProductsUnderAutograd) {
  run([&](const DeviceMesh& mesh, int64_t) {
    const at::Tensor x = data({2, 5, 7}, 0.1), w = data({3, 7}, 0.2), g = data({2, 5, 3}, 0.3);
    const at::Tensor dg = distribute_tensor(g, mesh, on(mesh, Replicate()));
    for (bool transposed : {true, false}) {
      const at::Tensor wm = transposed ? w : w.t().contiguous();
      at::Tensor xr = x.clone().requires_grad_(), wr = wm.clone().requires_grad_();
      const at::Tensor ref = transposed ? at::linear(xr, wr) : at::matmul(xr, wr);
      (ref * g).sum().backward();
      for (auto px : {Shard(0), Shard(1), Shard(2), Replicate()}) {
        for (auto pw : {Shard(0), Shard(1), Replicate()}) {
          SCOPED_TRACE(std::string(transposed ? "linear " : "matmul ") + px.str() + " x " + pw.str());
          const int64_t out_dim = transposed ? 0 : 1;
          const bool planned = (px.is_replicate() && !(pw.is_shard() && pw.dim != out_dim)) ||
                               (px.is_shard() && px.dim == 2 && pw.is_shard() && pw.dim != out_dim) ||
                               (px.is_shard() && px.dim < 2 && pw.is_replicate());
          auto product = [&](const at::Tensor& a, const at::Tensor& b) {
            return transposed ? at::linear(a, b) : at::matmul(a, b);
          };
          const at::Tensor fx = distribute_tensor(x.clone().requires_grad_(), mesh, on(mesh, px));
          const at::Tensor fw = distribute_tensor(wm.clone().requires_grad_(), mesh, on(mesh, pw));
          at::Tensor fy;
          const int64_t ops = dtensorOps([&] { fy = product(fx, fw); });
          if (planned) {
            EXPECT_EQ(ops, 0);
            EXPECT_EQ(fy.grad_fn()->name(), "dtp::FusedOutBackward");
          } else {
            EXPECT_GT(ops, 1);
          }
          EXPECT_CLOSE(full_tensor(fy), ref, 0.0, 1e-12);
          (fy * dg).sum().backward();
          EXPECT_CLOSE(full_tensor(fx.grad()), xr.grad(), 0.0, 1e-12);
          EXPECT_CLOSE(full_tensor(fw.grad()), wr.grad(), 0.0, 1e-12);
          if (planned) {
            // The output is the no-graph path's (one DTensor op and its rule), bit for bit.
            at::NoGradGuard no_grad;
            const at::Tensor ny = product(fx.detach(), fw.detach());
            EXPECT_EQ(placements(ny), placements(fy));
            EXPECT_TRUE(to_local(ny).equal(to_local(fy)));
          }
          const at::Tensor hx = distribute_tensor(x.clone().requires_grad_(), mesh, on(mesh, px));
          const at::Tensor hw = distribute_tensor(wm.clone().requires_grad_(), mesh, on(mesh, pw));
          {
            // The decomposition may place the output elsewhere (x Shard(1) is
            // flattened: all_to_all to Shard(0)); its gradients are the same.
            ExplicitRedistributeGuard warn(ExplicitRedistributeMode::Warn);
            (product(hx, hw) * dg).sum().backward();
          }
          EXPECT_CLOSE(full_tensor(hx.grad()), full_tensor(fx.grad()), 0.0, 1e-15);
          EXPECT_CLOSE(full_tensor(hw.grad()), full_tensor(fw.grad()), 0.0, 1e-15);
        }
      }
    }
  });
}

// A graph kept for a second backward (retain_graph) may get its output's
// gradient in another placement: each pass settles the input gradients'
// placements anew (all replicated: a Partial(sum) gradient, then a
// Replicate one).
TEST_P(FusedOps, RetainedGraphSettlesPlacementsPerPass) {
  run([&](const DeviceMesh& mesh, int64_t ranks) {
    const at::Tensor x = data({2, 5, 7}, 0.1), w = data({7, 3}, 0.2), g = data({2, 5, 3}, 0.3);
    const at::Tensor dx = distribute_tensor(x.clone().requires_grad_(), mesh, on(mesh, Replicate()));
    const at::Tensor dw = distribute_tensor(w, mesh, on(mesh, Replicate()));
    const at::Tensor y = at::matmul(dx, dw);
    ASSERT_EQ(y.grad_fn()->name(), "dtp::FusedOutBackward");
    const at::Tensor partial = from_local(g / static_cast<double>(ranks), mesh, on(mesh, Partial()), false,
                                          g.sizes().vec());
    const at::Tensor replicated = distribute_tensor(g, mesh, on(mesh, Replicate()));
    const at::Tensor once = at::matmul(g, w.t());
    y.backward(partial, /*retain_graph=*/true);
    EXPECT_CLOSE(full_tensor(dx.grad()), once, 0.0, 1e-14);
    y.backward(replicated);
    EXPECT_EQ(placements(dx.grad()), placements(dx));
    EXPECT_CLOSE(full_tensor(dx.grad()), 2 * once, 0.0, 1e-14);
  });
}

// A backward with create_graph=true through a fused op is refused by name
// (its gradient would not be differentiable again); under
// DecomposeFusedOpsGuard the same forward decomposes, and the second
// derivative equals one device's.
TEST_P(FusedOps, CreateGraphNeedsTheDecomposition) {
  run([&](const DeviceMesh& mesh, int64_t) {
    const at::Tensor x = data({2, 5, 7}, 0.1), w = data({7, 3}, 0.2);
    // The gradient is taken at a non-leaf (x * 2); a leaf's, which passes its
    // placement hook: GradReductionTest.LeafGradientKeepsItsHistoryUnderCreateGraph.
    at::Tensor xr = x.clone().requires_grad_(), wr = w.clone().requires_grad_();
    const at::Tensor x2r = xr * 2;
    const at::Tensor gr = torch::autograd::grad({at::matmul(x2r, wr).pow(2).sum()}, {x2r}, {}, true, true)[0];
    gr.pow(2).sum().backward();
    auto make = [&] {
      return std::make_pair(distribute_tensor(x.clone().requires_grad_(), mesh, on(mesh, Replicate())) * 2,
                            distribute_tensor(w.clone().requires_grad_(), mesh, on(mesh, Shard(1))));
    };
    {
      auto [dx, dw] = make();
      const at::Tensor loss = at::matmul(dx, dw).pow(2).sum();
      dtp::test::expect_error([&] { torch::autograd::grad({loss}, {dx}, {}, true, true); },
                              "create_graph=true through aten::matmul");
    }
    auto [dx, dw] = make();
    at::Tensor loss;
    {
      DecomposeFusedOpsGuard decompose;
      EXPECT_TRUE(DecomposeFusedOpsGuard::enabled());
      EXPECT_GT(dtensorOps([&] { loss = at::matmul(dx, dw).pow(2).sum(); }), 2);
      at::NoGradGuard no_grad;
      EXPECT_GT(dtensorOps([&] { (void)at::matmul(dx, dw); }), 1);
    }
    EXPECT_FALSE(DecomposeFusedOpsGuard::enabled());
    const at::Tensor g = torch::autograd::grad({loss}, {dx}, {}, true, true)[0];
    g.pow(2).sum().backward();
    EXPECT_CLOSE(full_tensor(dw.grad()), wr.grad(), 0.0, 1e-12);
  });
}

TEST_P(FusedOps, ModulesAndInferenceMode) {
  run([&](const DeviceMesh& mesh, int64_t) {
    nn::Linear lin(torch::nn::LinearOptions(7, 4).bias(false));
    torch::nn::Linear stock(torch::nn::LinearOptions(7, 4).bias(false));
    const at::Tensor x = data({2, 5, 7}, 0.4), w = data({4, 7}, 0.9), ref = at::matmul(x, w.t());
    set_parameter(*lin, "weight", distribute_tensor(w, mesh, on(mesh, Shard(0))));
    set_parameter(*stock, "weight", distribute_tensor(w, mesh, on(mesh, Shard(0))));
    const at::Tensor dx = distribute_tensor(x, mesh, on(mesh, Replicate()));
    at::Tensor out, stock_out;
    {
      // dtp's Linear calls aten::linear: one DTensor op. libtorch's computes
      // input.matmul(weight.t()): t and one matmul.
      at::NoGradGuard no_grad;
      EXPECT_EQ(dtensorOps([&] { out = lin(dx); }), 1);
      EXPECT_EQ(dtensorOps([&] { stock_out = stock(dx); }), 2);
    }
    EXPECT_EQ(placements(out), on(mesh, Shard(2)));
    EXPECT_CLOSE(full_tensor(out), ref, 1e-12, 1e-12);
    EXPECT_TRUE(at::equal(full_tensor(out), full_tensor(stock_out)));
    {
      c10::InferenceMode inference;  // no autograd keys: straight to the DTensor kernel
      EXPECT_EQ(dtensorOps([&] { out = lin(dx); }), 1);
      EXPECT_EQ(dtensorOps([&] { stock_out = stock(dx); }), 2);
      EXPECT_CLOSE(full_tensor(out), ref, 1e-12, 1e-12);
    }
  });
}

TEST_P(FusedOps, OtherShapesAndTapesDecompose) {
  run([&](const DeviceMesh& mesh, int64_t) {
    const at::Tensor v = data({7}, 0.5), m = data({7, 3}, 0.6), x = data({2, 5, 7}, 0.7), y = data({2, 7, 3}, 0.8);
    const at::Tensor dm = distribute_tensor(m, mesh, on(mesh, Shard(1)));
    const at::Tensor dx = distribute_tensor(x, mesh, on(mesh, Shard(0)));
    const at::Tensor dy = distribute_tensor(y, mesh, on(mesh, Replicate()));
    const at::Tensor dv = distribute_tensor(v, mesh, on(mesh, Replicate()));
    at::NoGradGuard no_grad;
    at::Tensor out;
    // A batched right operand or a vector weight: not the rule's shapes, ATen's decomposition.
    EXPECT_GT(dtensorOps([&] { out = at::matmul(dx, dy); }), 1);
    EXPECT_CLOSE(full_tensor(out), at::matmul(x, y), 1e-12, 1e-12);
    EXPECT_GT(dtensorOps([&] { out = at::linear(dx, dv); }), 1);
    EXPECT_CLOSE(full_tensor(out), at::linear(x, v), 1e-12, 1e-12);
    {
      // Selective activation checkpointing's first pass runs without a graph
      // but records for a recomputation that has one: the same ops both times.
      dtp::detail::ResultTape tape;
      dtp::detail::TapeScope scope(&tape, dtp::detail::TapeKind::SavedOps);
      EXPECT_GT(dtensorOps([&] { out = at::matmul(dx, dm); }), 1);
    }
    EXPECT_EQ(dtensorOps([&] { out = at::matmul(dx, dm); }), 1);
  });
}

// dtp::nn::rms_norm: no DTensor op where the rows are whole on each rank,
// with a graph (NOTE: [Fused ops under autograd]: a plain graph between two
// DTensor-level nodes, no DTensor op in its backward either) or without; the same local values as the
// decomposition, equal to one device, gradients of x and of the weight too,
// also where the output's gradient comes back Partial(sum) (a Colwise
// matmul after the norm); the decomposition with a tape, a sharded last
// dim, a Partial input or a sharded weight (the values equal either way).
TEST_P(FusedOps, RmsNormNormalizesEachRanksRows) {
  run([&](const DeviceMesh& mesh, int64_t ranks) {
    const at::Tensor x = data({3, 5, 8}, 0.3), w = data({8}, 0.2) + 1, m = data({8, 6}, 0.1);
    const at::Tensor ref = x * at::rsqrt(x.pow(2).mean({-1}, true) + 1e-6) * w;
    const at::Tensor dw = distribute_tensor(w, mesh, on(mesh, Replicate()));
    for (auto px : {Shard(0), Shard(1), Shard(2), Replicate()}) {
      SCOPED_TRACE(px.str());
      const bool whole_rows = !(px.is_shard() && px.dim == 2);
      const at::Tensor dx = distribute_tensor(x, mesh, on(mesh, px));
      at::Tensor fused, graphed;
      {
        at::NoGradGuard no_grad;
        EXPECT_EQ(dtensorOps([&] { fused = nn::rms_norm(dx, dw, 1e-6); }), whole_rows ? 0 : 6);
      }
      // Gradients through a matmul by a Colwise (Shard(1)) matrix: with a
      // replicated x the norm's output gradient is Partial(sum).
      const at::Tensor gx = distribute_tensor(x.clone().requires_grad_(), mesh, on(mesh, px));
      const at::Tensor gw = distribute_tensor(w.clone().requires_grad_(), mesh, on(mesh, Replicate()));
      const at::Tensor dm = distribute_tensor(m, mesh, on(mesh, Shard(1)));
      EXPECT_EQ(dtensorOps([&] { graphed = nn::rms_norm(gx, gw, 1e-6); }), whole_rows ? 0 : 6);
      EXPECT_EQ(placements(fused), placements(graphed));
      EXPECT_TRUE(to_local(fused).equal(to_local(graphed).detach()));
      EXPECT_CLOSE(full_tensor(fused), ref, 0.0, 1e-15);
      const at::Tensor y = at::matmul(graphed, dm);
      const at::Tensor ones = at::ones_like(y);  // a DTensor like y
      int64_t backward_ops = dtensorOps([&] { y.backward(ones); });
      if (whole_rows) {
        EXPECT_EQ(graphed.grad_fn()->name(), "dtp::FusedOutBackward");
        // The matmul's backward (about 4 ops) and none of the norm's (the decomposition: about 10 more).
        EXPECT_LE(backward_ops, 6);
      }
      at::Tensor xr = x.clone().requires_grad_(), wr = w.clone().requires_grad_();
      at::matmul(xr * at::rsqrt(xr.pow(2).mean({-1}, true) + 1e-6) * wr, m).sum().backward();
      EXPECT_EQ(placements(gx.grad()), placements(gx));
      EXPECT_EQ(placements(gw.grad()), placements(gw));
      EXPECT_CLOSE(full_tensor(gx.grad()), xr.grad(), 0.0, 1e-14);
      EXPECT_CLOSE(full_tensor(gw.grad()), wr.grad(), 0.0, 1e-14);
      // The decomposition (explicit-redistribution mode turns the fused path
      // off) gives the same gradients, bit for bit where the output's
      // gradient needs no redistribution (a replicated x keeps it Partial);
      // a sharded x takes it reduce-scattered first, where the decomposition
      // reduces later: the same values to rounding (checked above).
      const at::Tensor hx = distribute_tensor(x.clone().requires_grad_(), mesh, on(mesh, px));
      const at::Tensor hw = distribute_tensor(w.clone().requires_grad_(), mesh, on(mesh, Replicate()));
      {
        ExplicitRedistributeGuard warn(ExplicitRedistributeMode::Warn);
        at::Tensor decomposed;
        EXPECT_EQ(dtensorOps([&] { decomposed = nn::rms_norm(hx, hw, 1e-6); }), 6);
        EXPECT_TRUE(to_local(decomposed).equal(to_local(graphed)));
        at::matmul(decomposed, dm).backward(ones);
      }
      if (px.is_replicate() || !whole_rows) {
        EXPECT_TRUE(to_local(hx.grad()).equal(to_local(gx.grad())));
        EXPECT_TRUE(to_local(hw.grad()).equal(to_local(gw.grad())));
      }
    }
    at::NoGradGuard no_grad;
    const at::Tensor dx = distribute_tensor(x, mesh, on(mesh, Shard(0)));
    {
      dtp::detail::ResultTape tape;  // activation checkpointing's first pass
      dtp::detail::TapeScope scope(&tape, dtp::detail::TapeKind::Collectives);
      EXPECT_EQ(dtensorOps([&] { (void)nn::rms_norm(dx, dw, 1e-6); }), 6);
    }
    const at::Tensor partial = from_local(x / static_cast<double>(ranks), mesh, on(mesh, Partial()), false, x.sizes().vec());
    at::Tensor out;
    EXPECT_GT(dtensorOps([&] { out = nn::rms_norm(partial, dw, 1e-6); }), 0);
    EXPECT_CLOSE(full_tensor(out), ref, 0.0, 1e-14);
    const at::Tensor sharded_w = distribute_tensor(w, mesh, on(mesh, Shard(0)));
    EXPECT_GT(dtensorOps([&] { out = nn::rms_norm(dx, sharded_w, 1e-6); }), 0);
    EXPECT_CLOSE(full_tensor(out), ref, 0.0, 1e-15);
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, FusedOps, dtp::test::mesh_shapes(), dtp::test::mesh_name);

}  // namespace
