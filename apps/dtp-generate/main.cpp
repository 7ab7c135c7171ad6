// dtp-generate: samples text with tensor parallelism from a dtp-train
// checkpoint (any layout it was saved at; the model's config comes from it)
// or a Hugging Face Llama folder:
//   dtprun -n 2 dtp-generate --checkpoint ck          (its newest step-<N>/)
//   dtprun -n 2 dtp-generate --hf Llama-2-7b-hf --prompt "The capital of France is"
//   dtprun -n 2 dtp-generate --hf Qwen2.5-0.5B-Instruct --chat "Why is the sky blue?" --system "Be brief."
//   dtprun -n 2 dtp-generate --checkpoint ck --cp 2 --prompt-file long.txt   (the prefill over 2 ranks)
#include "../common/checkpoint_flags.h"
#include "../common/inference_setup.h"
#include "../common/model_flags.h"
#include "../common/parallel_flags.h"

#include "dtp/comm_counter.h"
#include "dtp/dcp/checkpoint.h"
#include "dtp/dtensor.h"
#include "dtp/models/checkpoint.h"
#include "dtp/models/generate.h"
#include "dtp/models/hf_llama.h"
#include "dtp/models/llama.h"
#include "dtp/text/chat.h"
#include "dtp/text/hf_tokenizer.h"
#include "dtp/text/tokenizer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>

int main(int argc, char** argv) {
  using namespace dtp;
  using namespace dtp::models;
  apps::ModelFlags model_flags;
  std::string checkpoint, hf, tokenizer_path, prompt_file, chat, system, chat_date, device = "cpu";
  bool no_think = false;
  std::vector<std::string> prompts;
  int64_t max_new_tokens = 200, context = 0, top_k = 0;
  apps::InferenceParallelFlags layout;
  double temperature = 0.0, top_p = 1.0;
  uint64_t seed = 0;
  CLI::App app{"dtp-generate: sample text from a dtp-train checkpoint or a Hugging Face Llama with tensor parallelism"};
  auto* ck = app.add_option("--checkpoint", checkpoint, "Folder written by dtp-train --save (its newest complete "
                            "step-<N>/), one step folder, or an older single file; the model flags are then taken "
                            "from it");
  app.add_option("--hf", hf, "Hugging Face Llama folder (config.json, safetensors, tokenizer.json or tokenizer.model)")->excludes(ck);
  app.add_option("--tokenizer", tokenizer_path,
                 "A model folder, tokenizer.json (Hugging Face), tokenizer.model (sentencepiece) or \"byte\" "
                 "[default: the --hf folder (its tokenizer.json, else tokenizer.model), else byte]");
  apps::add_model_flags(app, model_flags, /*inference=*/true);
  auto* prompt_opt = app.add_option("--prompt", prompts, "Text to continue (repeat for a batch)");
  auto* prompt_file_opt = app.add_option("--prompt-file", prompt_file, "A file of prompts, one per line (a batch)");
  auto* chat_opt = app.add_option("--chat", chat,
                                  "A user message, formatted with the chat template of the tokenizer's folder "
                                  "(tokenizer_config.json: Llama 3 / 3.1-3.3, ChatML for Qwen, Mistral [INST], "
                                  "Llama 2 chat); prints the reply")
                       ->excludes(prompt_opt)
                       ->excludes(prompt_file_opt);
  app.add_option("--system", system, "A system message for --chat")->needs(chat_opt);
  app.add_option("--chat-date", chat_date,
                 "With --chat on Llama 3.1/3.2/3.3: the system header's Today Date (HF's date_string, e.g. "
                 "\"27 Nov 2026\") [default: today's for a template that calls strftime_now (Llama 3.2), else the "
                 "template's own (\"26 Jul 2024\")]")
      ->needs(chat_opt);
  app.add_flag("--no-think", no_think, "With --chat on Qwen 3: enable_thinking=false (an empty <think> block)")
      ->needs(chat_opt);
  app.add_option("--max-new-tokens,--tokens", max_new_tokens, "Tokens to generate per prompt")->check(dtp::apps::kPositive);
  app.add_option("--context", context, "KV cache length per sequence [default: the model's max_seq_len]")
      ->check(dtp::apps::kPositive);
  app.add_option("--temperature", temperature, "0: greedy; else sample from softmax(logits / T)")
      ->check(dtp::apps::kNonNegative);
  app.add_option("--top-k", top_k, "Sample among the k most likely tokens (0: all)")->check(dtp::apps::kNonNegative);
  app.add_option("--top-p", top_p, "Sample among the most likely tokens holding this mass")->check(CLI::Range(1e-9, 1.0));
  app.add_option("--seed", seed, "Sampling seed (the same on every rank)");
  apps::add_inference_parallel_flags(app, layout);
  app.add_option("--device", device, "cpu, or cuda: each rank on GPU LOCAL_RANK (untested on a GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    layout.check();  // before the model: a wrong layout fails fast
    if (!prompt_file.empty()) {
      std::ifstream in(prompt_file);
      TORCH_CHECK(in.good(), "cannot read --prompt-file '", prompt_file, "'.");
      for (std::string line; std::getline(in, line);) {
        if (!line.empty()) prompts.push_back(line);
      }
    }
    if (prompts.empty() && chat.empty()) prompts = {"The "};
    TORCH_CHECK(!checkpoint.empty() || !hf.empty(), "pass --checkpoint DIR or --hf DIR.");
    ProcessGroup world = init_process_group();
    apps::InferenceSetup setup =
        apps::resolve_inference(app, model_flags, checkpoint, hf, tokenizer_path, context, world.rank() == 0);
    checkpoint = setup.checkpoint;
    const auto& tokenizer = setup.tokenizer;
    const std::string& folder = setup.tokenizer_folder;  // its chat template and end tokens
    std::vector<int64_t>& stop_tokens = setup.stop_tokens;
    if (!chat.empty()) {
      const auto* hf_tokenizer = dynamic_cast<const HfTokenizer*>(tokenizer.get());
      TORCH_CHECK(hf_tokenizer != nullptr, "dtp-generate: --chat needs a Hugging Face tokenizer.json: got the "
                  "tokenizer ", tokenizer->name(), ", expected a model folder with tokenizer.json and "
                  "tokenizer_config.json, so that the template's special tokens encode as their ids. Pass the "
                  "folder with --hf or --tokenizer.");
      const ChatTemplate tmpl = ChatTemplate::from_folder(folder);
      const std::optional<std::string> date = chat_date.empty() ? std::nullopt : std::optional<std::string>(chat_date);
      const std::optional<std::string> sys = system.empty() ? std::nullopt : std::optional<std::string>(system);
      prompts = {tmpl.format(sys, chat, !no_think, date)};
      // The turn's end (<|eot_id|>, <|im_end|>) ends the reply even where
      // generation_config.json lists only the base model's EOS.
      if (const auto end = hf_tokenizer->token_to_id(tmpl.end_of_turn());
          end && std::find(stop_tokens.begin(), stop_tokens.end(), *end) == stop_tokens.end()) {
        stop_tokens.push_back(*end);
      }
      if (world.rank() == 0) {
        std::string stops;
        for (const int64_t id : stop_tokens) stops += (stops.empty() ? "" : ", ") + std::to_string(id);
        const std::string today = tmpl.today_date(date);
        std::cerr << "dtp-generate: chat: " << tmpl.family_name() << " template of " << tmpl.source()
                  << (today.empty() ? "" : " (Today Date: " + today + ")") << ", prompt "
                  << tokenizer->encode(prompts[0], /*add_bos=*/false).size() << " tokens, stops at [" << stops << "]\n";
      }
    }
    Llama model =
        apps::load_inference_model(setup, hf, device, world.size(), layout, apps::weight_only_of(model_flags));
    std::cerr << "dtp-generate: " << apps::memory_after_load(world.rank()) << std::endl;
    std::vector<std::vector<int64_t>> ids;
    // A chat prompt holds its BOS already (the template writes bos_token).
    for (const auto& p : prompts) ids.push_back(tokenizer->encode(p, /*add_bos=*/chat.empty()));
    GenerateOptions o;
    o.max_new_tokens = max_new_tokens;
    o.sampling = {temperature, top_k, top_p};
    o.seed = seed;
    o.stop_tokens = stop_tokens;
    GenerateStats stats;
    CommCounter comm;  // all of generate's messages: the prefill's are those less decode's
    const auto out = generate(model, ids, o, &stats);
    const int64_t prefill_collectives = comm.total_count() - stats.decode_collectives;
    if (world.rank() == 0) {
      for (size_t b = 0; b < ids.size(); ++b) {
        // A chat prints the reply alone; a prompt is printed with its continuation.
        std::vector<int64_t> all = chat.empty() ? ids[b] : std::vector<int64_t>();
        for (int64_t t : out[b]) {
          if (t < tokenizer->vocab_size()) all.push_back(t);
        }
        // The whole text decoded at once: sentencepiece drops a leading
        // space at the start of what it decodes. Special tokens (a prompt's
        // <|begin_of_text|>, a chat's end token) are not shown.
        std::cout << tokenizer->decode(all, /*skip_special_tokens=*/true) << "\n";
      }
      std::vector<double> ms = stats.decode_ms;
      std::sort(ms.begin(), ms.end());
      auto pct = [&](double q) { return ms.empty() ? 0.0 : ms[static_cast<size_t>(q * (ms.size() - 1))]; };
      double total = 0;
      for (double m : ms) total += m;
      int64_t generated = 0;
      for (const auto& s : out) generated += static_cast<int64_t>(s.size());
      std::printf("dtp-generate: %zu prompt(s), %s: prefill %.1f ms (%lld collectives), decode %.2f ms/token p50, "
                  "%.2f p90, %.0f tokens/s, %.1f collectives/token\n",
                  ids.size(), apps::layout_name(world.size(), layout).c_str(), stats.prefill_ms,
                  static_cast<long long>(prefill_collectives), pct(0.5), pct(0.9),
                  total > 0 ? 1000.0 * (generated - static_cast<int64_t>(out.size())) / total : 0.0,
                  ms.empty() ? 0.0 : static_cast<double>(stats.decode_collectives) / ms.size());
    }
  } catch (const c10::Error& e) {
    std::cerr << "dtp-generate: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "dtp-generate: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
