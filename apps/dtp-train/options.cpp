// dtp-train's command line (options.h).
#include "options.h"

#include "../common/checks.h"
#include "../common/parallel_flags.h"

#include "dtp/models/hf_llama.h"

namespace dtp::apps::train {

using namespace dtp::models;

void add_options(CLI::App& app, Options& o) {
  app.add_option("--data", o.data, "Text file or directory [default: Debian's fortunes]");
  apps::add_model_flags(app, o.model);
  apps::add_moe_flags(app, o.model);
  app.add_option("--steps", o.steps, "Optimizer steps")->check(dtp::apps::kPositive);
  app.add_option("--batch", o.batch, "Sequences per step")->check(dtp::apps::kPositive);
  app.add_option("--seq", o.seq, "Tokens per sequence")->check(dtp::apps::kPositive);
  app.add_option("--lr", o.lr, "AdamW learning rate")->check(dtp::apps::kPositive);
  app.add_option("--dropout", o.dropout, "Dropout after attention and MLP")->check(CLI::Range(0.0, 0.99));
  app.add_option("--seed", o.seed, "Seed for init, batches and dropout");
  app.add_option("--tp", o.tp, "Tensor-parallel degree [default: WORLD_SIZE / dp]")->check(dtp::apps::kPositive);
  app.add_option("--dp", o.dp, "Data-parallel degree [default: WORLD_SIZE / (pp * tp)]; pp * dp * tp = WORLD_SIZE")
      ->check(dtp::apps::kPositive);
  app.add_option("--ep", o.ep, "Expert-parallel degree (--experts): each MoE layer's experts spread over ep "
                 "ranks, borrowed from data parallelism (dp x ep ranks train on slices of the batch) and from --cp "
                 "(a multiple of cp, the cp ranks among the ep ones); pp * dp * ep * tp = WORLD_SIZE")
      ->check(dtp::apps::kPositive)->capture_default_str();
  app.add_option("--cp", o.cp, "Context-parallel degree: each sequence's positions spread over cp ranks (ring or "
                 "all-to-all attention), parameters data parallel over dp x cp; pp * dp * cp * tp = WORLD_SIZE "
                 "(with --ep: pp * dp * ep * tp)")
      ->check(dtp::apps::kPositive)->capture_default_str();
  apps::add_cp_attention_flags(app, o.cp_attention, o.cp_layout, /*prefill=*/false);
  app.add_option("--pp", o.pp, "Pipeline-parallel degree: the layers cut into pp stages, each rank allocating its "
                 "stage only")->check(dtp::apps::kPositive)->capture_default_str();
  app.add_option("--microbatches", o.microbatches, "Microbatches per step under --pp [default: pp]")
      ->check(dtp::apps::kPositive);
  app.add_option("--schedule", o.pipeline_schedule, "Pipeline schedule under --pp")
      ->check(CLI::IsMember({"gpipe", "1f1b"}))
      ->capture_default_str();
  auto* fsdp = app.add_flag("--fsdp", o.fsdp, "Data parallelism as FSDP (fully_shard per block) [default]");
  app.add_flag("--ddp", o.ddp, "Data parallelism as DDP (replicate, bucketed all-reduce)")->excludes(fsdp);
  app.add_option("--mixed-precision,--mp", o.mixed_precision, "Mixed precision under every layout (TP, DDP, FSDP, "
                 "HSDP, pipelines): bf16 compute, float32 master weights and gradient reduction; f16: the same in float16 "
                 "with loss scaling (GradScaler), not with --pp")
      ->check(CLI::IsMember({"bf16", "f16"}));
  app.add_option("--ac", o.ac, "Activation checkpointing of the transformer blocks")
      ->check(CLI::IsMember({"none", "full", "selective"}))
      ->capture_default_str();
  app.add_option("--ac-every", o.ac_every, "Checkpoint every k-th block (--ac full)")->check(dtp::apps::kPositive);
  app.add_option("--clip", o.clip, "Clip the gradients' total norm to this (0: no clipping)")
      ->check(dtp::apps::kNonNegative);
  app.add_flag("--eager-init", o.eager_init,
               "Build and initialize the whole model on every rank before sharding it (default: deferred init, "
               "each rank allocates and initializes its shards only)");
  app.add_option("--warmup", o.warmup, "Steps of linear learning-rate warmup")->check(dtp::apps::kNonNegative);
  app.add_option("--lr-schedule", o.lr_schedule, "After warmup: constant, or cosine decay to lr/10")
      ->check(CLI::IsMember({"constant", "cosine"}))
      ->capture_default_str();
  app.add_option("--log-every", o.log_every, "Steps between progress lines")->check(dtp::apps::kPositive);
  app.add_flag("--no-sp", o.no_sp, "Disable sequence parallelism");
  app.add_flag("--shard-experts", o.shard_experts, "MoE under --tp: cut each expert's hidden units over tp "
               "(ExpertTensorParallel) instead of replicating the experts; not with --ep");
  app.add_flag("--check-parity", o.check_parity,
               "Also train on one device and compare (exact in float64; float32 against one device's own error)");
  app.add_option("--device", o.device, "cpu, or cuda: each rank on GPU LOCAL_RANK")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--save", o.save, "Write sharded checkpoints into this folder, one step-<N>/ folder per save "
                 "(each atomic; nothing else in the folder is touched)");
  app.add_option("--save-every", o.save_every, "Also save every N steps, in the background (needs --save)")
      ->check(dtp::apps::kPositive);
  app.add_option("--keep-last", o.keep_last, "Keep only the newest K step folders of --save (removes only dtp's own "
                 "older step-<N>/ folders)")->check(dtp::apps::kPositive);
  app.add_option("--resume", o.resume, "Continue from a --save folder (its newest complete step-<N>/) or one step "
                 "folder, at any dp/tp/pp layout; the model config comes from the checkpoint");
  app.add_option("--init-from-hf", o.init_from_hf,
                 "Fine-tune a Hugging Face Llama folder: its config, weights and tokenizer.model (the model size "
                 "flags are ignored)");
  app.add_option("--comm-debug", o.comm_debug,
                 "Write the first step's collectives per module (forward and backward), op and type, per rank, "
                 "as JSON to this file (CommDebugMode)");
  app.add_option("--metrics", o.metrics,
                 "Write one JSON line per logged step to this file: loss, tokens/s, step ms, peak memory, "
                 "collectives and bytes per step, gradient norm, learning rate (plot it with scripts/plot.sh)");
  app.add_option("--profile", o.profile,
                 "Write a Chrome/Perfetto trace per rank (DIR/rankR.json) of --profile-steps steps after the first, "
                 "through libtorch's profiler: DTensor ops with placements, redistributions, collectives with bytes");
  app.add_option("--profile-steps", o.profile_steps, "Steps --profile traces")->check(dtp::apps::kPositive)->capture_default_str();
  app.add_option("--save-hf", o.save_hf, "Also export the trained model as a Hugging Face folder here");
}

std::optional<MixedPrecisionPolicy> mpPolicy(const Options& o) {
  if (o.mixed_precision.empty()) return std::nullopt;
  MixedPrecisionPolicy p;
  p.param_dtype = o.mixed_precision == "f16" ? at::kHalf : at::kBFloat16;
  p.reduce_dtype = at::kFloat;
  return p;
}

LlamaConfig configOf(const Options& o) {
  if (o.saved_config) {
    LlamaConfig c = *o.saved_config;
    c.max_seq_len = o.seq;
    c.dropout = o.dropout;
    c.seed = o.seed;
    c.dtype = apps::dtype_of(o.model.dtype);
    return c;
  }
  if (o.init_from_hf.empty()) return apps::config_of(o.model, o.seq, o.dropout, o.seed);
  LlamaConfig c = llama_config_from_hf(o.init_from_hf, o.seq);
  c.dropout = o.dropout;
  c.seed = o.seed;
  c.dtype = apps::dtype_of(o.model.dtype);
  return c;
}

}  // namespace dtp::apps::train
