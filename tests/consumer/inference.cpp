// dtp::inference alone: greedy and top-1 sampling of plain logits.
#include <dtp/inference/sampling.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <iostream>

int main() {
  const at::Tensor logits = at::tensor({0.1, 2.0, -1.0, 0.5, /**/ 3.0, 0.0, 1.0, 2.5}, at::kDouble).view({2, 4});
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(0);
  const std::vector<int64_t> greedy = dtp::inference::sample(logits, {}, gen);
  dtp::inference::SamplingOptions top1;
  top1.temperature = 0.7;
  top1.top_k = 1;
  const std::vector<int64_t> drawn = dtp::inference::sample(logits, top1, gen);
  const std::vector<int64_t> want{1, 0};
  const bool ok = greedy == want && drawn == want;
  std::cout << "dtp::inference: " << (ok ? "OK" : "FAILED") << ": greedy " << greedy[0] << " " << greedy[1] << "\n";
  return ok ? 0 : 1;
}
