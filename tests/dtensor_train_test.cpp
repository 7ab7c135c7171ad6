// torch::nn modules with DTensor parameters train exactly like on one device:
// a Linear and a 2-layer MLP, 5 AdamW steps, on 2 and 4 ranks; and
// dtp::optim::AdamW against torch::optim::AdamW.
#include "close.h"
#include "comm/compat.h"
#include "dist.h"
#include "parity.h"

#include "dtp/module_utils.h"
#include "dtp/optim/adamw.h"

#include <ATen/record_function.h>

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
        EXPECT_CLOSE(full_tensor(params[i]), ref_params[step][i], 1e-5, 1e-5)
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

// Ops on this thread that reach dtp with a DTensor argument (ops that
// decompose above dtp, CompositeImplicitAutograd, are left out).
thread_local int64_t dtensor_ops = 0;
std::unique_ptr<at::ObserverContext> countDTensorOp(const at::RecordFunction& fn) {
  auto name = fn.operator_name();
  if (!name) return nullptr;
  auto op = c10::Dispatcher::singleton().findOp(*name);
  if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) return nullptr;
  for (const auto& v : fn.inputs()) {
    if (v.isTensor() && is_dtensor(v.toTensor())) {
      ++dtensor_ops;
      break;
    }
  }
  return nullptr;
}

const torch::optim::AdamWParamState& adamState(torch::optim::Optimizer& opt, const at::Tensor& p) {
  return static_cast<const torch::optim::AdamWParamState&>(*opt.state().at(compat::optimizer_state_key(p)));
}

// dtp::optim::AdamW runs libtorch's AdamW on the shards: parameters and state
// equal torch::optim::AdamW's on the same DTensors bit for bit, its step makes
// no DTensor op, and the state stays DTensors with the parameters' specs. A
// gradient in other placements than its parameter's (a Partial bias gradient
// at step 1) takes the DTensor path. The step bumps the parameters' versions:
// a graph that saved one before fails in backward.
TEST(DTensorTrainTest, ShardLocalAdamWMatchesTorchAdamW) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    const at::Tensor x = distribute_tensor(data({5, 6}, 1.0).to(at::kFloat), mesh, {Replicate()});
    const at::Tensor y = distribute_tensor(data({5, 3}, 2.0).to(at::kFloat), mesh, {Replicate()});
    for (bool amsgrad : {false, true}) {
      SCOPED_TRACE(amsgrad ? "amsgrad" : "adamw");
      Mlp ref(6, 9, 3), fast(6, 9, 3);  // uneven hidden: local rows 5 and 4
      for (Mlp* m : {&ref, &fast}) {
        shard(m->fc1, mesh, Shard(0), Shard(0));
        shard(m->fc2, mesh, Shard(1), Replicate());
      }
      const auto options = torch::optim::AdamWOptions(0.05).weight_decay(0.01).amsgrad(amsgrad);
      torch::optim::AdamW ref_opt(ref.parameters(), options);
      dtp::optim::AdamW fast_opt(fast.parameters(), options);
      for (int step = 0; step < 3; ++step) {
        for (auto [m, opt] : {std::pair<Mlp*, torch::optim::Optimizer*>{&ref, &ref_opt}, {&fast, &fast_opt}}) {
          opt->zero_grad();
          loss(m->forward(x), y).backward();
          if (step == 1) m->fc2->bias.mutable_grad() = from_local(at::full({3}, rank + 1.0), mesh, {Partial()});
        }
        ref_opt.step();
        const int64_t version = fast.fc1->weight._version();
        dtensor_ops = 0;
        auto handle = at::addThreadLocalCallback(
            at::RecordFunctionCallback(&countDTensorOp).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
        fast_opt.step();
        at::removeCallback(handle);
        EXPECT_EQ(dtensor_ops > 0, step == 1) << "step " << step << ": " << dtensor_ops << " DTensor ops";
        if (step == 1)  // zero_grad would keep it Partial
          for (Mlp* m : {&ref, &fast}) m->fc2->bias.mutable_grad().reset();
        EXPECT_GT(fast.fc1->weight._version(), version);
        const auto rp = ref.parameters(), fp = fast.parameters();
        for (size_t i = 0; i < fp.size(); ++i) {
          SCOPED_TRACE("step " + std::to_string(step) + " param " + std::to_string(i));
          EXPECT_TRUE(to_local(fp[i]).equal(to_local(rp[i])));
          const auto &rs = adamState(ref_opt, rp[i]), &fs = adamState(fast_opt, fp[i]);
          EXPECT_EQ(fs.step(), rs.step());
          for (auto [f, r] : {std::pair{fs.exp_avg(), rs.exp_avg()}, {fs.exp_avg_sq(), rs.exp_avg_sq()},
                              {fs.max_exp_avg_sq(), rs.max_exp_avg_sq()}}) {
            ASSERT_EQ(f.defined(), amsgrad || r.defined());
            if (!f.defined()) continue;
            EXPECT_EQ(dtensor_spec(f), dtensor_spec(fp[i]));
            EXPECT_TRUE(to_local(f).equal(to_local(r)));
          }
        }
      }
      at::Tensor stale = loss(fast.forward(x), y);
      fast_opt.step();
      EXPECT_THROW(stale.backward(), c10::Error);
    }
  });
}

}  // namespace
