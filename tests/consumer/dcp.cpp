// dtp::dcp alone, without the model (dtprun -n 2): a sharded state dict
// saved as Shard(0) and loaded back into Shard(1).
#include <dtp/dcp/checkpoint.h>
#include <dtp/device_mesh.h>
#include <dtp/dtensor.h>

#include <ATen/ATen.h>

#include <iostream>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: use_dcp DIR\n";
    return 2;
  }
  const std::string dir = std::string(argv[1]) + "/ckpt";
  dtp::init_process_group();
  auto mesh = dtp::init_device_mesh("cpu", {2}, {"dp"});
  at::manual_seed(0);  // the same tensors on every rank
  const at::Tensor w = at::randn({6, 4}, at::kDouble);
  const at::Tensor b = at::arange(5, at::kDouble);

  dtp::dcp::StateDict saved;
  saved.add("w", dtp::distribute_tensor(w, mesh, {dtp::Shard(0)}));
  saved.add("b", b.clone());
  saved.metadata["step"] = "3";
  dtp::dcp::save(saved, dir);

  dtp::dcp::StateDict loaded;
  loaded.add("w", dtp::distribute_tensor(at::zeros_like(w), mesh, {dtp::Shard(1)}));
  loaded.add("b", at::zeros_like(b));
  const auto metadata = dtp::dcp::load(loaded, dir);
  const bool ok = at::equal(dtp::full_tensor(loaded.tensors[0].second), w) && at::equal(loaded.tensors[1].second, b) &&
                  metadata.at("step") == "3";
  std::cout << "dtp::dcp: " << (ok ? "OK" : "FAILED") << ": S(0) saved, S(1) loaded\n";
  return ok ? 0 : 1;
}
