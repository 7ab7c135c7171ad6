// PyTorch's loss_parallel example, in C++. Run: dtprun -n 2 tp_loss_parallel
//
//   Python                                             C++
//   input = torch.randn(4, 16, requires_grad=True)     at::Tensor input = at::randn({4, 16}).requires_grad_();
//   dist_input = distribute_tensor(input, device_mesh,  at::Tensor dist_input = dtp::distribute_tensor(input, device_mesh,
//                                  placements=[Shard(1)])                                   {dtp::Shard(1)});
//   target = torch.randint(16, (4,))                   at::Tensor target = at::randint(16, {4});
//   with loss_parallel():                              { dtp::LossParallelGuard loss_parallel;
//       loss = F.cross_entropy(dist_input, target,       loss = F::cross_entropy(dist_input, target,
//                              reduction="mean")           F::CrossEntropyFuncOptions().reduction(torch::kMean));
//       loss.backward()                                  loss.backward(); }
#include <dtp/comm_counter.h>
#include <dtp/dtensor.h>
#include <dtp/tp/loss_parallel.h>

#include <torch/nn/functional/loss.h>

#include <iostream>

namespace F = torch::nn::functional;

int main() {
  dtp::init_process_group();
  auto device_mesh = dtp::init_device_mesh("cpu", {2});
  at::manual_seed(0);  // the same input and target on every rank
  at::Tensor input = at::randn({4, 16}, at::kDouble).requires_grad_();
  at::Tensor dist_input = dtp::distribute_tensor(input, device_mesh, {dtp::Shard(1)});
  at::Tensor target = at::randint(16, {4});
  dtp::CommCounter comm;
  at::Tensor loss;
  {
    dtp::LossParallelGuard loss_parallel;
    loss = F::cross_entropy(dist_input, target, F::CrossEntropyFuncOptions().reduction(torch::kMean));
    loss.backward();
  }
  // One device, for comparison.
  at::Tensor same = input.detach().clone().requires_grad_();
  at::Tensor expected = F::cross_entropy(same, target);
  expected.backward();
  const double diff = std::max((dtp::full_tensor(loss) - expected).abs().item<double>(),
                               (dtp::full_tensor(dist_input.grad()) - same.grad()).abs().max().item<double>());
  std::cout << "loss " << dtp::full_tensor(loss).item<double>() << ", " << comm.str()
            << ", " << (diff < 1e-12 ? "matches one device" : "DIFFERS from one device") << " (max |difference| " << diff << ")\n";
  return diff < 1e-12 ? 0 : 1;
}
