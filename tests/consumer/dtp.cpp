// dtp::dtp alone (dtprun -n 2): a DTensor sharded over two ranks.
#include <dtp/device_mesh.h>
#include <dtp/dtensor.h>

#include <ATen/ATen.h>

#include <iostream>

int main() {
  dtp::init_process_group();
  auto mesh = dtp::init_device_mesh("cpu", {2}, {"x"});
  at::manual_seed(0);  // the same tensor on every rank
  const at::Tensor full = at::randn({5, 3}, at::kDouble);
  const at::Tensor d = dtp::distribute_tensor(full, mesh, {dtp::Shard(0)});
  const at::Tensor twice = dtp::full_tensor(d * 2);  // one all_gather
  const bool ok = at::equal(twice, full * 2);
  std::cout << "dtp::dtp: " << (ok ? "OK" : "FAILED") << ": " << dtp::dtensor_spec(d).str() << "\n";
  return ok ? 0 : 1;
}
