// dtp::io alone: a safetensors file written and read back.
#include <dtp/io/safetensors.h>

#include <ATen/ATen.h>

#include <iostream>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: use_io DIR\n";
    return 2;
  }
  const std::string path = std::string(argv[1]) + "/t.safetensors";
  at::manual_seed(0);
  const at::Tensor a = at::randn({3, 4}, at::kDouble);
  const at::Tensor i = at::arange(5, at::kLong);
  dtp::io::save_safetensors(path, {{"a", a}, {"i", i}}, {{"step", "7"}});
  const dtp::io::Checkpoint back = dtp::io::load_safetensors(path);
  const bool ok = back.tensors.size() == 2 && back.tensors[0].first == "a" && at::equal(back.tensors[0].second, a) &&
                  back.tensors[1].first == "i" && at::equal(back.tensors[1].second, i) &&
                  back.metadata.at("step") == "7";
  std::cout << "dtp::io: " << (ok ? "OK" : "FAILED") << ": safetensors round trip\n";
  return ok ? 0 : 1;
}
