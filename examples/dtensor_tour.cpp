// The README's API tour, compiled and run by the tests (dtprun -n 2).
#include <dtp/comm_counter.h>
#include <dtp/device_mesh.h>
#include <dtp/dtensor.h>
#include <dtp/module_utils.h>

#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <iostream>

int main() {
  dtp::init_process_group();  // RANK, WORLD_SIZE, MASTER_ADDR... as torchrun sets them
  auto mesh = dtp::init_device_mesh("cpu", {2}, {"tp"});

  // A DTensor is an at::Tensor: ordinary ATen code runs on it.
  at::manual_seed(0);  // same data on every rank
  at::Tensor w = dtp::distribute_tensor(at::randn({6, 4}), mesh, {dtp::Shard(0)});
  at::Tensor x = dtp::distribute_tensor(at::randn({3, 4}), mesh, {dtp::Replicate()});
  at::Tensor y = at::relu(at::matmul(x, w.t()));  // S(1): columns stay on their rank
  std::cout << dtp::dtensor_spec(y).str() << "\n";  // f32[3,6](S(1))

  dtp::CommCounter comm;
  at::Tensor full = dtp::full_tensor(y);  // one all_gather
  std::cout << comm.str() << "\n";

  // torch::nn modules and optimizers work with DTensor parameters.
  torch::nn::Linear lin(4, 6);
  at::Tensor weight = dtp::distribute_tensor(lin->weight.detach().requires_grad_(), mesh, {dtp::Shard(0)});
  at::Tensor bias = dtp::distribute_tensor(lin->bias.detach().requires_grad_(), mesh, {dtp::Shard(0)});
  dtp::replace_parameter(*lin, "weight", weight);
  dtp::replace_parameter(*lin, "bias", bias);
  lin->weight = weight;  // the public fields are separate handles
  lin->bias = bias;
  torch::optim::AdamW opt(lin->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    at::Tensor loss = lin(x).pow(2).mean();
    loss.backward();
    opt.step();
    std::cout << "step " << step << " loss " << loss.item<float>() << "\n";
  }
  std::cout << "weight " << dtp::dtensor_spec(lin->weight).str() << ", grad "
            << dtp::dtensor_spec(lin->weight.grad()).str() << "\n";
  return 0;
}
