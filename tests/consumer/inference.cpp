// dtp::inference alone: greedy and top-1 sampling of plain logits, and the
// serving engine over a model of the program's own (model.h's four calls):
// it counts, each token the last one plus 1.
#include <dtp/inference/engine.h>
#include <dtp/inference/sampling.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <iostream>
#include <memory>

namespace {

class Counter final : public dtp::inference::Model {
 public:
  at::Tensor forward(const at::Tensor& tokens, dtp::inference::KVCache&, const std::vector<int64_t>& valid) override {
    at::Tensor logits = at::zeros({tokens.size(0), 1, vocab_size()}, at::kFloat);
    for (int64_t b = 0; b < tokens.size(0); ++b) {
      logits[b][0][(tokens[b][valid[b] - 1].item<int64_t>() + 1) % vocab_size()] = 1.0;
    }
    return logits;
  }
  dtp::inference::KvShape kv_shape() const override { return {1, 1, 1, 1, at::kFloat, c10::Device(c10::kCPU)}; }
  int64_t vocab_size() const override { return 10; }
  int64_t max_seq_len() const override { return 32; }
};

}  // namespace

int main() {
  const at::Tensor logits = at::tensor({0.1, 2.0, -1.0, 0.5, /**/ 3.0, 0.0, 1.0, 2.5}, at::kDouble).view({2, 4});
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(0);
  const std::vector<int64_t> greedy = dtp::inference::sample(logits, {}, gen);
  dtp::inference::SamplingOptions top1;
  top1.temperature = 0.7;
  top1.top_k = 1;
  const std::vector<int64_t> drawn = dtp::inference::sample(logits, top1, gen);
  const std::vector<int64_t> want{1, 0};
  dtp::inference::Engine engine(std::make_shared<Counter>(), dtp::inference::EngineOptions{});
  dtp::inference::RequestOptions o;
  o.max_tokens = 4;
  engine.enqueue({7, 8}, o);
  std::vector<int64_t> counted;
  while (engine.step()) {}
  for (const auto& out : engine.poll()) counted.insert(counted.end(), out.tokens.begin(), out.tokens.end());
  const bool ok = greedy == want && drawn == want && counted == std::vector<int64_t>{9, 0, 1, 2};
  std::cout << "dtp::inference: " << (ok ? "OK" : "FAILED") << ": greedy " << greedy[0] << " " << greedy[1]
            << ", the engine counted " << counted.size() << " tokens\n";
  return ok ? 0 : 1;
}
