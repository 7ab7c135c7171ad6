// dtp-train's command line: its options, their flags, and what they mean
// for the model (the config, the mixed-precision policy).
#pragma once

#include "../common/corpus.h"
#include "../common/model_flags.h"

#include "dtp/amp/mixed_precision.h"
#include "dtp/models/llama.h"

#include <CLI/CLI.hpp>

#include <cstdint>
#include <optional>
#include <string>

namespace dtp::apps::train {

struct Options {
  std::string data = apps::kDefaultCorpus;
  apps::ModelFlags model;
  int64_t steps = 200, batch = 8, seq = 64, log_every = 20, tp = 0, dp = 0, pp = 1, ep = 1, cp = 1, warmup = 0,
          ac_every = 1;
  std::string cp_attention = "ring", cp_layout = "head-tail";
  int microbatches = 0;
  std::string pipeline_schedule = "1f1b";
  double lr = 3e-3, dropout = 0.0, clip = 0.0;
  std::string ac = "none", lr_schedule = "constant";
  uint64_t seed = 0;
  bool no_sp = false, shard_experts = false, check_parity = false, ddp = false, fsdp = false, eager_init = false;
  std::string save, resume, mixed_precision, device = "cpu", init_from_hf, save_hf, comm_debug, metrics, profile;
  int64_t save_every = 0, keep_last = 0, profile_steps = 3;
  // --resume: the config the checkpoint records (NOTE: [Config in the checkpoint]).
  std::optional<models::LlamaConfig> saved_config;
};

// Every flag of dtp-train on `app`, writing into `o`.
void add_options(CLI::App& app, Options& o);

// --mixed-precision bf16 (--mp): bf16 compute, float32 master weights and
// gradient reduction, under every layout (FSDP's and DDP's mp_policy, or
// apply_mixed_precision for TP alone and one device).
std::optional<MixedPrecisionPolicy> mpPolicy(const Options& o);

// The model flags' config, or with --init-from-hf the folder's (fine-tuning),
// or with --resume the checkpoint's.
models::LlamaConfig configOf(const Options& o);

}  // namespace dtp::apps::train
