// PyTorch's parallelize_module example with a plan of FQNs and wildcards, in
// C++. Run: dtprun -n 2 tp_parallelize_plan
//
//   Python                                            C++
//   m = parallelize_module(m, tp_mesh, {              dtp::parallelize_module(*m, tp_mesh, {
//       "layers.*.w1": ColwiseParallel(),                 {"layers.*.w1", dtp::ColwiseParallel()},
//       "layers.*.w2": RowwiseParallel(),                 {"layers.*.w2", dtp::RowwiseParallel()},
//   })                                                });
#include <dtp/comm_counter.h>
#include <dtp/dtensor.h>
#include <dtp/nn/modules.h>
#include <dtp/tp/parallelize.h>

#include <torch/nn/modules/container/modulelist.h>

#include <iostream>

struct MlpImpl : torch::nn::Module {
  dtp::nn::Linear w1{register_module("w1", dtp::nn::Linear(16, 64))};
  dtp::nn::Linear w2{register_module("w2", dtp::nn::Linear(64, 16))};
  at::Tensor forward(const at::Tensor& x) { return x + w2(at::relu(w1(x))); }
};
DTP_MODULE(Mlp);

struct ModelImpl : torch::nn::Module {
  torch::nn::ModuleList layers{register_module("layers", torch::nn::ModuleList(Mlp(), Mlp(), Mlp()))};
  at::Tensor forward(at::Tensor x) {
    for (const auto& layer : *layers) x = dtp::nn::run_hooked(*layer->as<dtp::nn::HookedImpl<MlpImpl>>(), x);
    return x;
  }
};
TORCH_MODULE(Model);

int main() {
  dtp::init_process_group();
  auto tp_mesh = dtp::init_device_mesh("cpu", {2});
  at::manual_seed(0);  // the same weights and input on every rank
  Model m, reference;
  m->to(at::kDouble);
  reference->to(at::kDouble);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : m->named_parameters()) p.value().copy_(reference->named_parameters()[p.key()]);
  }
  dtp::parallelize_module(*m, tp_mesh, {
      {"layers.*.w1", dtp::ColwiseParallel()},
      {"layers.*.w2", dtp::RowwiseParallel()},
  });
  const at::Tensor x = at::randn({4, 16}, at::kDouble);
  dtp::CommCounter comm;
  at::Tensor y = m(x);
  const double diff = (y - reference(x)).abs().max().item<double>();
  std::cout << "layers.0.w1.weight " << dtp::dtensor_spec(m->named_parameters()["layers.0.w1.weight"]).str()
            << ", forward " << comm.str() << ", " << (diff < 1e-12 ? "matches one device" : "DIFFERS from one device") << " (max |difference| " << diff << ")\n";
  return diff < 1e-12 ? 0 : 1;
}
