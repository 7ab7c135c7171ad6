// dtp-generate's and dtp-serve's layout of the ranks: --ep, --cp,
// --cp-attention, --cp-layout (load_inference_model reads them); the last
// two as dtp-train takes them too.
#pragma once

#include "checks.h"

#include "dtp/cp/context_parallel.h"
#include "dtp/models/parallelize.h"

#include <CLI/CLI.hpp>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cstdint>
#include <string>

namespace dtp::apps {

// --cp-attention and --cp-layout's values as the options of apply_context_parallel.
inline models::ContextParallelOptions cp_options_of(const std::string& attention, const std::string& layout) {
  models::ContextParallelOptions o;
  o.attention =
      attention == "ring" ? models::ContextParallelAttention::Ring : models::ContextParallelAttention::AllToAll;
  o.layout = layout == "head-tail" ? CpLayout::HeadTail : CpLayout::Contiguous;
  return o;
}

// Adds --cp-attention and --cp-layout; `prefill`: the inference apps, whose
// attention runs over cp in the prompt's prefill only.
inline void add_cp_attention_flags(CLI::App& app, std::string& attention, std::string& layout, bool prefill) {
  app.add_option("--cp-attention", attention, c10::str(prefill ? "Prefill attention" : "Attention", " over the cp ranks: "
                 "ring (any head count) or all_to_all (Ulysses: heads per tp rank divisible by cp)"))
      ->check(CLI::IsMember({"ring", "all_to_all"}))->capture_default_str();
  app.add_option("--cp-layout", layout, c10::str(prefill ? "Prompt positions" : "Positions", " per cp rank: "
                 "head-tail (two chunks, balanced causal work) or contiguous (one chunk, the naive layout)"))
      ->check(CLI::IsMember({"head-tail", "contiguous"}))->capture_default_str();
}

struct InferenceParallelFlags {
  int64_t ep = 1, cp = 1;
  std::string cp_attention = "ring", cp_layout = "head-tail", cp_kv_cache = "replicated";

  models::ContextParallelOptions cp_options() const {
    models::ContextParallelOptions o = cp_options_of(cp_attention, cp_layout);
    o.kv_cache = cp_kv_cache == "sharded" ? models::CpKvCache::Sharded : models::CpKvCache::Replicated;
    return o;
  }

  // ep borrows the cp ranks, as in dtp-train (NOTE: [Context parallelism
  // with expert parallelism] in src/models/llama_parallelize.cpp).
  void check() const {
    TORCH_CHECK(ep == 1 || cp == 1 || ep % cp == 0, "--ep ", ep, " with --cp ", cp, ": expert parallelism borrows "
                "the cp ranks (the experts spread over ep ranks that hold whole cp groups), so ep must be a "
                "multiple of cp. Use --ep ", cp, " or another multiple of ", cp, ".");
    TORCH_CHECK(cp > 1 || cp_kv_cache == "replicated", "--cp-kv-cache ", cp_kv_cache, " with --cp ", cp, ": the cache "
                "spreads over the cp ranks, and there is one. Give --cp 2 or more, or leave --cp-kv-cache out.");
  }
};

inline void add_inference_parallel_flags(CLI::App& app, InferenceParallelFlags& f) {
  app.add_option("--ep", f.ep, "Expert-parallel degree for MoE models: each MoE layer's experts spread over ep "
                 "ranks, the rest tensor parallel over tp = ranks / ep. With --cp, ep borrows the cp ranks (a "
                 "multiple of cp, as dtp-train's)")
      ->check(kPositive)->capture_default_str();
  app.add_option("--cp", f.cp, "Context-parallel degree: a prompt's prefill spread over cp ranks by position (ring "
                 "or all-to-all attention), then decode on every cp rank alike over the KV cache (--cp-kv-cache); "
                 "the ranks form a (cp, tp) mesh with tp = ranks / cp")
      ->check(kPositive)->capture_default_str();
  add_cp_attention_flags(app, f.cp_attention, f.cp_layout, /*prefill=*/true);
  app.add_option("--cp-kv-cache", f.cp_kv_cache, "The KV cache under --cp: replicated (every cp rank holds every "
                 "block; decode sends nothing over cp) or sharded (each cp rank holds 1/cp of the blocks, so the "
                 "cache holds cp times the tokens per rank's memory; one all_gather per layer and step)")
      ->check(CLI::IsMember({"replicated", "sharded"}))->capture_default_str();
}

// "TP=2", "EP=2 x TP=1", "CP=2 x TP=1" or "EP=4 (over CP=2) x TP=1": how
// load_inference_model lays out `world_size` ranks.
inline std::string layout_name(int world_size, const InferenceParallelFlags& f) {
  if (f.ep > 1 && f.cp > 1) return c10::str("EP=", f.ep, " (over CP=", f.cp, ") x TP=", world_size / f.ep);
  return f.ep > 1   ? c10::str("EP=", f.ep, " x TP=", world_size / f.ep)
         : f.cp > 1 ? c10::str("CP=", f.cp, " x TP=", world_size / f.cp)
                    : c10::str("TP=", world_size);
}

}  // namespace dtp::apps
