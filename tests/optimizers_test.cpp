// libtorch's optimizers on DTensor parameters (#26): Adam (and amsgrad),
// AdamW, SGD (momentum, dampening, Nesterov, weight decay) and RMSprop
// (centered, momentum, weight decay) take 4 steps on parameters sharded on
// each dim, unevenly, and replicated, on meshes (2), (4) and (2,2), and equal
// the same optimizer on one device in float64.
#include "mesh_test.h"
#include "parity.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

using namespace dtp;
using dtp::test::data;

namespace {

using MakeOptimizer = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

struct Case {
  const char* name;
  MakeOptimizer make;
};

std::vector<Case> cases() {
  using namespace torch::optim;
  auto adam = [](AdamOptions o) {
    return [o](std::vector<at::Tensor> p) -> std::unique_ptr<Optimizer> { return std::make_unique<Adam>(p, o); };
  };
  auto adamw = [](AdamWOptions o) {
    return [o](std::vector<at::Tensor> p) -> std::unique_ptr<Optimizer> { return std::make_unique<AdamW>(p, o); };
  };
  auto sgd = [](SGDOptions o) {
    return [o](std::vector<at::Tensor> p) -> std::unique_ptr<Optimizer> { return std::make_unique<SGD>(p, o); };
  };
  auto rmsprop = [](RMSpropOptions o) {
    return [o](std::vector<at::Tensor> p) -> std::unique_ptr<Optimizer> { return std::make_unique<RMSprop>(p, o); };
  };
  return {{"Adam", adam(AdamOptions(0.05))},
          {"Adam amsgrad weight_decay", adam(AdamOptions(0.05).amsgrad(true).weight_decay(0.1))},
          {"AdamW", adamw(AdamWOptions(0.05).weight_decay(0.1))},
          {"SGD", sgd(SGDOptions(0.1))},
          {"SGD momentum dampening weight_decay", sgd(SGDOptions(0.1).momentum(0.9).dampening(0.2).weight_decay(0.05))},
          {"SGD nesterov", sgd(SGDOptions(0.1).momentum(0.9).nesterov(true))},
          {"RMSprop", rmsprop(RMSpropOptions(0.01))},
          {"RMSprop centered momentum weight_decay",
           rmsprop(RMSpropOptions(0.01).centered(true).momentum(0.5).weight_decay(0.05))}};
}

// A small network's loss: x [6,5] through w1 [7,5] (tanh) and w2 [7,3] plus b [3].
at::Tensor loss(const std::vector<at::Tensor>& p, const at::Tensor& x) {
  const at::Tensor out = at::tanh(x.matmul(p[0].t())).matmul(p[1]) + p[2];
  return (out * out).sum() + p[0].pow(2).sum() * 0.1;
}

using Optimizers = dtp::test::MeshTest;

TEST_P(Optimizers, EqualOneDeviceInFloat64) {
  const std::vector<at::Tensor> init = {data({7, 5}, 0.1) * 0.5, data({7, 3}, 0.2) * 0.5, data({3}, 0.3) * 0.1};
  const at::Tensor x = data({6, 5}, 1.0);
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    // One device.
    std::vector<at::Tensor> ref;
    for (const auto& t : init) ref.push_back(t.clone().requires_grad_());
    auto ref_opt = c.make(ref);
    for (int step = 0; step < 4; ++step) {
      ref_opt->zero_grad();
      loss(ref, x).backward();
      ref_opt->step();
    }
    // 7 rows or columns: uneven on 2 and 4 ranks.
    const std::vector<std::vector<Placement>> layouts = {
        {Shard(0), Shard(0), Replicate()}, {Shard(1), Shard(1), Shard(0)}, {Replicate(), Replicate(), Replicate()}};
    run([&](const DeviceMesh& mesh, int64_t) {
      for (const auto& layout : layouts) {
        SCOPED_TRACE(layout[0].str() + layout[1].str() + layout[2].str());
        std::vector<at::Tensor> params;
        for (size_t i = 0; i < init.size(); ++i)
          params.push_back(distribute_tensor(init[i].clone().requires_grad_(), mesh, on(mesh, layout[i])));
        auto opt = c.make(params);
        const at::Tensor dx = distribute_tensor(x, mesh, on(mesh, Replicate()));
        for (int step = 0; step < 4; ++step) {
          opt->zero_grad();
          loss(params, dx).backward();
          opt->step();
        }
        for (size_t i = 0; i < params.size(); ++i) {
          EXPECT_EQ(placements(params[i]), on(mesh, layout[i])) << "parameter " << i;
          const double diff = (full_tensor(params[i].detach()) - ref[i].detach()).abs().max().item<double>();
          // Sharded gradients are summed in another order (float64 rounding,
          // ~1e-15 of these O(1) gradients); Adam and RMSprop divide by the
          // gradient's own magnitude, so entries whose gradients pass near
          // zero amplify that rounding. Measured here: at most 4.8e-13; the
          // bound of dtp's parity tests (parity.h) leaves 200x for other
          // summation orders.
          EXPECT_LE(diff, 1e-10) << "parameter " << i;
        }
      }
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Meshes, Optimizers, dtp::test::mesh_shapes(), dtp::test::mesh_name);

}  // namespace
