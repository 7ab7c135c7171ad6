// torch::nn modules with DTensor parameters train exactly like on one device:
// a Linear and a 2-layer MLP, 5 AdamW steps, on 2 and 4 ranks.
#include "dist.h"
#include "parity.h"

#include "dtp/module_utils.h"

#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

using namespace dtp;
using dtp::test::data;
using dtp::test::run_ranks;

namespace {

// Two Linear layers with identical initial weights on every rank.
struct Mlp {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  Mlp(int64_t in, int64_t hidden, int64_t out) : fc1(in, hidden), fc2(hidden, out) {
    torch::NoGradGuard no_grad;
    fc1->weight.copy_(data({hidden, in}, 0.1).to(at::kFloat) * 0.5);
    fc1->bias.copy_(data({hidden}, 0.2).to(at::kFloat) * 0.1);
    fc2->weight.copy_(data({out, hidden}, 0.3).to(at::kFloat) * 0.5);
    fc2->bias.copy_(data({out}, 0.4).to(at::kFloat) * 0.1);
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(at::relu(fc1(x))); }
  std::vector<at::Tensor> parameters() {
    return {fc1->weight, fc1->bias, fc2->weight, fc2->bias};
  }
};

void shard(torch::nn::Linear& lin, const DeviceMesh& mesh, Placement w, Placement b) {
  auto weight = distribute_tensor(lin->weight.detach().requires_grad_(true), mesh, {w});
  auto bias = distribute_tensor(lin->bias.detach().requires_grad_(true), mesh, {b});
  replace_parameter(*lin, "weight", weight);
  replace_parameter(*lin, "bias", bias);
  lin->weight = weight;
  lin->bias = bias;
}

at::Tensor loss(const at::Tensor& out, const at::Tensor& target) {
  return (out - target).pow(2).mean();
}

void trainAndCompare(int w, int64_t hidden, Placement w1, Placement b1, Placement w2, Placement b2) {
  const int64_t batch = 5, in = 6, out = 3;
  const at::Tensor x = data({batch, in}, 1.0).to(at::kFloat);
  const at::Tensor y = data({batch, out}, 2.0).to(at::kFloat);
  // Single-device reference.
  Mlp ref(in, hidden, out);
  torch::optim::AdamW ref_opt(ref.parameters(), torch::optim::AdamWOptions(0.05).weight_decay(0.01));
  std::vector<std::vector<at::Tensor>> ref_params;
  std::vector<double> ref_losses;
  for (int step = 0; step < 5; ++step) {
    ref_opt.zero_grad();
    at::Tensor l = loss(ref.forward(x), y);
    l.backward();
    ref_opt.step();
    ref_losses.push_back(l.item<double>());
    std::vector<at::Tensor> snapshot;
    for (const auto& p : ref.parameters()) snapshot.push_back(p.detach().clone());
    ref_params.push_back(snapshot);
  }
  run_ranks(w, [&](int) {
    auto mesh = init_device_mesh("cpu", {w});
    Mlp model(in, hidden, out);
    shard(model.fc1, mesh, w1, b1);
    shard(model.fc2, mesh, w2, b2);
    // The module's own registry now holds the DTensors.
    for (const auto& p : model.fc1->parameters()) EXPECT_TRUE(is_dtensor(p));
    torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(0.05).weight_decay(0.01));
    at::Tensor dx = distribute_tensor(x, mesh, {Replicate()});
    at::Tensor dy = distribute_tensor(y, mesh, {Replicate()});
    for (int step = 0; step < 5; ++step) {
      opt.zero_grad();
      at::Tensor l = loss(model.forward(dx), dy);
      l.backward();
      opt.step();
      EXPECT_NEAR(l.item<double>(), ref_losses[step], 1e-5) << "step " << step;
      auto params = model.parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(full_tensor(params[i]).allclose(ref_params[step][i], 1e-5, 1e-5))
            << "step " << step << " param " << i;
      }
    }
    EXPECT_EQ(placements(model.fc1->weight), Placements{w1});
    EXPECT_EQ(placements(model.fc2->weight.grad()), Placements{w2});
  });
}

TEST(DTensorTrainTest, LinearWithShardedWeightMatchesSingleDevice) {
  for (int w : {2, 4}) {
    // One Linear: fc2 replicated, fc1 sharded either way.
    trainAndCompare(w, 4 * w, Shard(0), Shard(0), Replicate(), Replicate());
    trainAndCompare(w, 4 * w, Shard(1), Replicate(), Replicate(), Replicate());
  }
}

TEST(DTensorTrainTest, MegatronMlpMatchesSingleDevice) {
  for (int w : {2, 4}) {
    trainAndCompare(w, 4 * w, Shard(0), Shard(0), Shard(1), Replicate());  // even hidden
    trainAndCompare(w, 4 * w + 1, Shard(0), Shard(0), Shard(1), Replicate());  // uneven hidden
  }
}

}  // namespace
