// dtp-generate: samples text with tensor parallelism from a dtp-train
// checkpoint (any layout it was saved at) or a Hugging Face Llama folder:
//   dtprun -n 2 dtp-generate --checkpoint ck
//   dtprun -n 2 dtp-generate --hf Llama-2-7b-hf --prompt "The capital of France is"
#include "../common/model_flags.h"

#include "dtp/dcp/checkpoint.h"
#include "dtp/dtensor.h"
#include "dtp/models/checkpoint.h"
#include "dtp/models/hf_llama.h"
#include "dtp/models/llama.h"
#include "dtp/models/tokenizer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <filesystem>
#include <iostream>

int main(int argc, char** argv) {
  using namespace dtp;
  using namespace dtp::models;
  apps::ModelFlags model_flags;
  std::string checkpoint, hf, tokenizer_path, prompt = "The ";
  int64_t tokens = 200, context = 64;
  double temperature = 0.0;
  uint64_t seed = 0;
  CLI::App app{"dtp-generate: sample text from a dtp-train checkpoint or a Hugging Face Llama with tensor parallelism"};
  auto* ck = app.add_option("--checkpoint", checkpoint, "Folder written by dtp-train --save (or an older single file)");
  app.add_option("--hf", hf, "Hugging Face Llama folder (config.json, safetensors, tokenizer.model)")->excludes(ck);
  app.add_option("--tokenizer", tokenizer_path,
                 "tokenizer.model (sentencepiece) or \"byte\" [default: the --hf folder's tokenizer.model, else byte]");
  apps::add_model_flags(app, model_flags);
  app.add_option("--prompt", prompt, "Text to continue");
  app.add_option("--tokens", tokens, "Tokens to generate")->check(dtp::apps::kPositive);
  app.add_option("--context", context, "Context window (dtp-train's --seq)")->check(dtp::apps::kPositive);
  app.add_option("--temperature", temperature, "0: greedy; else sample from softmax(logits / T)")
      ->check(dtp::apps::kNonNegative);
  app.add_option("--seed", seed, "Sampling seed (the same on every rank)");
  CLI11_PARSE(app, argc, argv);
  try {
    TORCH_CHECK(!prompt.empty(), "--prompt must not be empty.");
    TORCH_CHECK(!checkpoint.empty() || !hf.empty(), "pass --checkpoint DIR or --hf DIR.");
    ProcessGroup world = init_process_group();
    LlamaConfig config = apps::config_of(model_flags, context, 0.0, 0);
    if (!hf.empty()) {
      config = llama_config_from_hf(hf, context);
      config.dtype = apps::dtype_of(model_flags.dtype);
      if (tokenizer_path.empty() && std::filesystem::exists(hf + "/tokenizer.model")) tokenizer_path = hf;
    }
    const auto tokenizer = load_tokenizer(tokenizer_path.empty() ? "byte" : tokenizer_path);
    TORCH_CHECK(tokenizer->vocab_size() <= config.vocab_size, "the tokenizer (", tokenizer->name(),
                ") has ", tokenizer->vocab_size(), " tokens, more than the model's vocab_size ", config.vocab_size,
                ". Pass the model's own tokenizer.model with --tokenizer.");
    Llama model(config);
    if (world.size() > 1) {
      auto mesh = init_device_mesh("cpu", {world.size()}, {"tp"});
      apply_tensor_parallel(model, mesh, TensorParallelOptions{/*sequence_parallel=*/false});
    }
    if (!hf.empty()) {
      load_hf_weights(model, hf);
    } else if (std::filesystem::is_regular_file(checkpoint)) {
      load_checkpoint(checkpoint, model, nullptr);
    } else {
      dcp::load_state(checkpoint, *model, nullptr, llama_state_dict_options());
    }
    model->eval();
    at::NoGradGuard no_grad;
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    std::vector<int64_t> ids = tokenizer->encode(prompt, /*add_bos=*/true);
    for (int64_t i = 0; i < tokens; ++i) {
      const int64_t n = std::min<int64_t>(context, static_cast<int64_t>(ids.size()));
      at::Tensor ctx = at::tensor(std::vector<int64_t>(ids.end() - n, ids.end()), at::kLong).view({1, n});
      at::Tensor logits = model(ctx).select(1, n - 1).squeeze(0);  // [vocab], vocab-sharded under TP
      if (is_dtensor(logits)) logits = full_tensor(logits);
      const int64_t next = temperature == 0.0
                               ? logits.argmax().item<int64_t>()
                               : at::multinomial(at::softmax(logits.to(at::kDouble) / temperature, -1), 1, false, gen)
                                     .item<int64_t>();
      if (tokenizer->eos_id() && next == *tokenizer->eos_id()) break;
      TORCH_CHECK(next < tokenizer->vocab_size(), "the model chose token ", next,
                  ", outside the tokenizer's ", tokenizer->vocab_size(), " tokens. Pass the model's own tokenizer.");
      ids.push_back(next);
    }
    // The whole text decoded at once: sentencepiece drops a leading space
    // at the start of what it decodes.
    if (world.rank() == 0) std::cout << tokenizer->decode(ids) << "\n";
  } catch (const c10::Error& e) {
    std::cerr << "dtp-generate: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "dtp-generate: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
