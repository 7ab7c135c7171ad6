// The README's tensor-parallel tour, compiled and run by the tests (dtprun -n 2).
#include <dtp/comm_counter.h>
#include <dtp/dtensor.h>
#include <dtp/nn/modules.h>
#include <dtp/tp/loss_parallel.h>
#include <dtp/tp/parallelize.h>

#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <iostream>

// A user module: fields are dtp::nn holders so that styles can hook them.
struct MlpImpl : torch::nn::Module {
  dtp::nn::Linear up{register_module("up", dtp::nn::Linear(16, 32))};
  dtp::nn::Linear down{register_module("down", dtp::nn::Linear(32, 16))};
  dtp::nn::Linear head{register_module("head", dtp::nn::Linear(16, 10))};
  at::Tensor forward(const at::Tensor& x) { return head(x + down(at::relu(up(x)))); }
};
DTP_MODULE(Mlp);

int main() {
  dtp::init_process_group();
  auto mesh = dtp::init_device_mesh("cpu", {2}, {"tp"});
  at::manual_seed(0);  // the same weights on every rank; rank 0's are scattered
  Mlp model;
  dtp::parallelize_module(*model, mesh, {
      {"up", dtp::ColwiseParallel()},
      {"down", dtp::RowwiseParallel()},
      // Vocabulary-sharded logits stay DTensors for loss_parallel.
      {"head", dtp::ColwiseParallel(dtp::ColwiseParallelOptions().use_local_output(false))},
  });
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  at::Tensor x = at::randn({8, 16}), labels = at::randint(10, {8});
  for (int step = 0; step < 3; ++step) {
    dtp::CommCounter comm;
    dtp::LossParallelGuard loss_parallel;  // cross-entropy without gathering the logits
    at::Tensor loss = torch::nn::functional::cross_entropy(model(x), labels);
    opt.zero_grad();
    loss.backward();
    opt.step();
    std::cout << "step " << step << " loss " << loss.item<double>() << " | " << comm.str() << "\n";
  }
  std::cout << "up.weight " << dtp::dtensor_spec(model->up->weight).str() << ", down.weight "
            << dtp::dtensor_spec(model->down->weight).str() << "\n";
}
