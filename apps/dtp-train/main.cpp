// dtp-train: the main job. For now a demo of the mesh and a checked all-reduce.
#include "dtp/device_mesh.h"

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include <iostream>

int main(int argc, char** argv) {
  CLI::App app{"dtp-train: tensor-parallel training with dtp (run under dtprun -n N)"};
  CLI11_PARSE(app, argc, argv);
  try {
    auto world = dtp::init_process_group();
    auto mesh = dtp::init_device_mesh("cpu", {world.size()}, {"tp"});
    std::cout << "rank " << world.rank() << " of " << world.size() << ": " << mesh << "\n";
    at::Tensor t = at::full({4}, world.rank() + 1, at::kFloat);
    mesh.get_group("tp").all_reduce(t);
    const float expect = world.size() * (world.size() + 1) / 2.0f;
    if (!t.eq(expect).all().item<bool>()) {
      std::cerr << "all_reduce gave " << t << ", expected " << expect << "\n";
      return 1;
    }
    std::cout << "all_reduce(rank+1) = " << expect << " on every element: ok\n";
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
