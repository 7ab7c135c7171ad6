// dtp-generate: loads a dtp-train checkpoint (any TP degree) and samples
// byte-level text with tensor parallelism: `dtprun -n 2 dtp-generate --checkpoint ck`.
#include "../common/model_flags.h"

#include "dtp/dtensor.h"
#include "dtp/models/checkpoint.h"
#include "dtp/models/llama.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <iostream>

int main(int argc, char** argv) {
  using namespace dtp;
  using namespace dtp::models;
  apps::ModelFlags model_flags;
  std::string checkpoint, prompt = "The ";
  int64_t tokens = 200, context = 64;
  double temperature = 0.0;
  uint64_t seed = 0;
  CLI::App app{"dtp-generate: sample text from a dtp-train checkpoint with tensor parallelism"};
  app.add_option("--checkpoint", checkpoint, "File written by dtp-train --save")->required();
  apps::add_model_flags(app, model_flags);
  app.add_option("--prompt", prompt, "Text to continue");
  app.add_option("--tokens", tokens, "Bytes to generate")->check(dtp::apps::kPositive);
  app.add_option("--context", context, "Context window (dtp-train's --seq)")->check(dtp::apps::kPositive);
  app.add_option("--temperature", temperature, "0: greedy; else sample from softmax(logits / T)")
      ->check(dtp::apps::kNonNegative);
  app.add_option("--seed", seed, "Sampling seed (the same on every rank)");
  CLI11_PARSE(app, argc, argv);
  try {
    TORCH_CHECK(!prompt.empty(), "dtp-generate: --prompt must not be empty.");
    ProcessGroup world = init_process_group();
    Llama model(apps::config_of(model_flags, context, 0.0, 0));
    if (world.size() > 1) {
      auto mesh = init_device_mesh("cpu", {world.size()}, {"tp"});
      apply_tensor_parallel(model, mesh, TensorParallelOptions{/*sequence_parallel=*/false});
    }
    load_checkpoint(checkpoint, model, nullptr);
    model->eval();
    at::NoGradGuard no_grad;
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    std::vector<int64_t> ids(prompt.begin(), prompt.end());
    for (auto& id : ids) id &= 0xff;
    std::string out = prompt;
    for (int64_t i = 0; i < tokens; ++i) {
      const int64_t n = std::min<int64_t>(context, static_cast<int64_t>(ids.size()));
      at::Tensor ctx = at::tensor(std::vector<int64_t>(ids.end() - n, ids.end()), at::kLong).view({1, n});
      at::Tensor logits = model(ctx).select(1, n - 1).squeeze(0);  // [vocab], vocab-sharded under TP
      if (is_dtensor(logits)) logits = full_tensor(logits);
      const int64_t next = temperature == 0.0
                               ? logits.argmax().item<int64_t>()
                               : at::multinomial(at::softmax(logits / temperature, -1), 1, false, gen).item<int64_t>();
      ids.push_back(next);
      out.push_back(static_cast<char>(next));
    }
    if (world.rank() == 0) std::cout << out << "\n";
  } catch (const std::exception& e) {
    std::cerr << "dtp-generate: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
