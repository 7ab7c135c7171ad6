// What dtp-generate and dtp-serve resolve alike from --checkpoint / --hf /
// --tokenizer / --context: the model's config (a checkpoint's recorded one,
// a Hugging Face folder's, or the model flags'), the checkpoint folder to
// load, the tokenizer (checked against the model's vocabulary), the folder
// of its files (chat template, end tokens) and the ids generation stops at.
#pragma once

#include "checkpoint_flags.h"
#include "model_flags.h"
#include "parallel_flags.h"
#include "proc_status.h"

#include "dtp/dcp/checkpoint.h"
#include "dtp/models/checkpoint.h"
#include "dtp/models/generate.h"
#include "dtp/models/hf_llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/text/chat.h"
#include "dtp/text/tokenizer.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace dtp::apps {

struct InferenceSetup {
  models::LlamaConfig config;
  std::string checkpoint;                       // resolved (a step-<N>/ folder or a file); "" without one
  std::unique_ptr<models::Tokenizer> tokenizer;
  std::string tokenizer_folder;                 // "" for the byte tokenizer
  std::vector<int64_t> stop_tokens;             // end_token_ids of the folder, else the tokenizer's EOS
};

// Every rank calls it; `log`: print the step folders find_checkpoint passed over.
inline InferenceSetup resolve_inference(CLI::App& app, ModelFlags& flags, const std::string& checkpoint,
                                        const std::string& hf, std::string tokenizer_path, int64_t context, bool log) {
  InferenceSetup s;
  s.checkpoint = checkpoint;
  s.config = config_of(flags, context > 0 ? context : 256, 0.0, 0);
  if (!checkpoint.empty() && !std::filesystem::is_regular_file(checkpoint)) {
    const SavedCheckpoint saved = find_saved_checkpoint(checkpoint, log);
    s.checkpoint = saved.path;
    if (saved.config) {
      adopt_saved_config(app, flags, *saved.config, saved.path);
      s.config = *saved.config;
      s.config.max_seq_len = context > 0 ? context : 256;  // as without a recorded config
    }
  }
  if (!hf.empty()) {
    s.config = models::llama_config_from_hf(hf, context);
    s.config.dtype = dtype_of(flags.dtype);
    if (tokenizer_path.empty() &&
        (std::filesystem::exists(hf + "/tokenizer.json") || std::filesystem::exists(hf + "/tokenizer.model"))) {
      tokenizer_path = hf;
    }
  }
  s.tokenizer = models::load_tokenizer(tokenizer_path.empty() ? "byte" : tokenizer_path);
  models::check_tokenizer_fits_model(*s.tokenizer, s.config.vocab_size,
                                     hf.empty() ? "checkpoint " + s.checkpoint : hf + "/config.json");
  if (!tokenizer_path.empty() && tokenizer_path != "byte") {
    s.tokenizer_folder = std::filesystem::is_directory(tokenizer_path)
                             ? tokenizer_path
                             : std::filesystem::path(tokenizer_path).parent_path().string();
  }
  if (!s.tokenizer_folder.empty()) {
    s.stop_tokens = models::end_token_ids(s.tokenizer_folder, *s.tokenizer);
  } else if (s.tokenizer->eos_id()) {
    s.stop_tokens = {*s.tokenizer->eos_id()};
  }
  return s;
}

// Hands malloc's free memory back to the system (glibc keeps freed heap
// memory for reuse): without it, what construction dropped stayed resident
// through the load, a peak of 0.48 GB instead of 0.42 GB per rank for a
// dim-1024 checkpoint at TP=2 (load_hf_model does so itself).
inline void release_freed_memory() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

// The model of `s` on a ("tp") mesh of every rank, or with `ep` > 1 an
// ("ep", "tp") mesh: the MoE layers' experts spread over ep (every rank runs
// the same tokens; each expert computes on its owner), the rest TP over tp.
// Parallelized for inference, with the --hf folder's or the checkpoint's
// weights (each rank reading its shards), in eval mode. Collective.
// With `weight_only` (weight_only_of: --dtype bfloat16 / float16, --quantize
// int8) the Linear weights are stored so: converted as each is read from a
// --hf folder, after the load from a checkpoint.
// With `cp` > 1 a ("cp", "tp") mesh: the prompt's prefill over cp (NOTE:
// [Context-parallel prefill] in src/models/llama_cp_prefill.cpp), TP over tp.
// With both, ep borrows the cp ranks as in training (NOTE: [Context
// parallelism with expert parallelism] in src/models/llama_parallelize.cpp):
// an ("ep", "cp", "tp") mesh of sizes (ep / cp, cp, tp), the experts over
// ("ep", "cp") flattened, the prefill's attention over "cp". ep / cp rows
// then run the same prompt, as ep's ranks do without cp.
inline models::Llama load_inference_model(InferenceSetup& s, const std::string& hf, const std::string& device,
                                          int world_size, const InferenceParallelFlags& layout = {},
                                          const std::optional<nn::WeightOnlyOptions>& weight_only = std::nullopt) {
  const int64_t ep = layout.ep, cp = layout.cp;
  TORCH_CHECK(ep == 1 || s.config.moe.num_experts > 0, "--ep ", ep, ": the model has no mixture-of-experts layers "
              "to spread. Drop --ep.");
  layout.check();
  const int64_t spread = std::max(ep, cp);  // the ranks tp divides
  TORCH_CHECK(world_size % spread == 0, ep > 1 ? "--ep " : "--cp ", spread, " does not divide the ", world_size,
              " ranks: the ranks form an (", ep > 1 ? "ep" : "cp", ", tp) mesh with tp = ranks / ",
              ep > 1 ? "ep" : "cp", ". Run a multiple of ", spread, " ranks.");
  const int64_t tp = world_size / spread;
  DeviceMesh mesh = ep > 1 && cp > 1 ? init_device_mesh(device, {ep / cp, cp, tp}, {"ep", "cp", "tp"})
                    : ep > 1         ? init_device_mesh(device, {ep, tp}, {"ep", "tp"})
                    : cp > 1         ? init_device_mesh(device, {cp, tp}, {"cp", "tp"})
                                     : init_device_mesh(device, {tp}, {"tp"});
  s.config.device = mesh.device();
  auto parallelize = [&](models::Llama& model) {
    if (ep > 1) models::apply_expert_parallel(model, cp > 1 ? mesh[{"ep", "cp"}].flatten("ep_cp") : mesh["ep"]);
    if (tp > 1) models::apply_tensor_parallel_for_inference(model, mesh["tp"]);
    if (cp > 1) models::apply_context_parallel(model, mesh["cp"], layout.cp_options());
  };
  models::Llama model{nullptr};
  if (!hf.empty()) {
    // Each rank allocates and reads only its shards: NOTE: [Loading only the shards].
    models::HFLoadOptions options;
    options.weight_only = weight_only;
    model = models::load_hf_model(s.config, hf, parallelize, options);
  } else if (std::filesystem::is_regular_file(s.checkpoint)) {  // the older single file: whole tensors
    model = models::Llama(s.config);
    parallelize(model);
    models::load_checkpoint(s.checkpoint, model, nullptr);
  } else {
    // Under TP every parameter becomes a DTensor (what the plan leaves plain
    // is replicated), so a model built on the meta device and parallelized
    // holds only its shards, allocated, which load_state fills: no rank
    // builds or initializes the whole model (NOTE: [Deferred
    // initialization]). On one rank, or EP alone, the parameters outside
    // the experts would stay on meta: built as before.
    models::LlamaConfig c = s.config;
    c.deferred_init = tp > 1;
    model = models::Llama(c);
    parallelize(model);
    release_freed_memory();  // the blocks built in full and dropped for meta
    dcp::load_state(s.checkpoint, *model, nullptr, models::llama_state_dict_options());
    model->awaiting_init = false;  // every parameter was loaded (load_state errors on a missing one)
  }
  if (weight_only && hf.empty()) models::to_weight_only(model, *weight_only);
  model->eval();
  release_freed_memory();  // a load's read buffers, whole parameters before sharding
  return model;
}

// "rank 0: memory after load 1.23 GB resident, peak 1.31 GB": this
// process's resident memory now (VmRSS) and its highest so far (VmHWM), in
// units of 10^9 bytes.
inline std::string memory_after_load(int rank) {
  const double kB = 1024.0 / 1e9;  // /proc's kB are KiB
  char line[128];
  std::snprintf(line, sizeof line, "rank %d: memory after load %.2f GB resident, peak %.2f GB", rank,
                proc_field_kb("/proc/self/status", "VmRSS:") * kB, proc_field_kb("/proc/self/status", "VmHWM:") * kB);
  return line;
}

}  // namespace dtp::apps
