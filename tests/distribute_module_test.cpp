// distribute_module and the hooked module holders.
#include "close.h"
#include "dist.h"
#include "parity.h"

#include "dtp/distribute_module.h"
#include "dtp/module_utils.h"
#include "dtp/nn/modules.h"

using namespace dtp;
using dtp::test::data;
using dtp::test::run_ranks;

namespace {

// A user module declared with DTP_MODULE, holding hooked children.
struct TwoLayerImpl : torch::nn::Module {
  dtp::nn::Linear fc1{nullptr}, fc2{nullptr};
  TwoLayerImpl() {
    fc1 = register_module("fc1", dtp::nn::Linear(4, 6));
    fc2 = register_module("fc2", dtp::nn::Linear(6, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(at::relu(fc1(x))); }
};
DTP_MODULE(TwoLayer);

// Same weights on every rank (construction draws them from a shared generator).
TwoLayer makeModel() {
  TwoLayer m;
  torch::NoGradGuard g;
  double seed = 0;
  for (auto& p : m->parameters()) p.copy_(data(p.sizes().vec(), seed += 1).to(at::kFloat));
  return m;
}

TEST(DistributeModuleTest, ShardsWhatPartitionFnSaysAndReplicatesTheRest) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    TwoLayer model = makeModel();
    at::Tensor w1 = model->fc1->weight.detach().clone();
    distribute_module(*model, mesh, [](const std::string& fqn, torch::nn::Module& m, const DeviceMesh& mesh) {
      if (fqn != "fc1") return;
      for (const auto& p : m.named_parameters(false))
        set_parameter(m, p.key(), distribute_tensor(p.value().detach().requires_grad_(), mesh, {Shard(0)}));
    });
    // Registry and public fields both hold the DTensors.
    EXPECT_EQ(placements(model->fc1->weight), Placements{Shard(0)});
    EXPECT_EQ(placements(model->named_parameters()["fc1.weight"]), Placements{Shard(0)});
    EXPECT_EQ(placements(model->fc2->weight), Placements{Replicate()});
    EXPECT_TRUE(model->fc2->bias.requires_grad());
    EXPECT_TRUE(to_local(model->fc1->weight).equal(w1.narrow(0, rank * 3, 3)));
  });
}

TEST(DistributeModuleTest, InputAndOutputFnsRunAsHooks) {
  run_ranks(2, [](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    TwoLayer model = makeModel();
    TwoLayer ref = makeModel();
    distribute_module(
        *model, mesh, nullptr,
        [](std::vector<at::Tensor>& in, const DeviceMesh& mesh) {
          in[0] = from_local(in[0], mesh, {Shard(0)});  // each rank feeds its rows
        },
        [](at::Tensor& out, const DeviceMesh&) { out = to_local(out); });
    at::Tensor x = data({4, 4}).to(at::kFloat);
    at::Tensor y = model(x.narrow(0, rank * 2, 2));
    EXPECT_FALSE(is_dtensor(y));
    EXPECT_CLOSE(y, ref(x).narrow(0, rank * 2, 2), 1e-5, 1e-5);
  });
}

TEST(DistributeModuleTest, HooksOnAPlainRootAreAnErrorNamingTheFix) {
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    torch::nn::Linear plain(4, 2);
    try {
      distribute_module(*plain, mesh, nullptr, [](std::vector<at::Tensor>&, const DeviceMesh&) {});
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("DTP_MODULE"), std::string::npos) << e.what();
    }
  });
}

TEST(DistributeModuleTest, UnknownModuleTypeNeedsFieldRegistration) {
  struct CustomImpl : torch::nn::Module {
    at::Tensor w;
    CustomImpl() { w = register_parameter("w", at::ones({2})); }
  };
  run_ranks(2, [](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto m = std::make_shared<CustomImpl>();
    try {
      distribute_module(*m, mesh);
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("register_parameter_fields"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
