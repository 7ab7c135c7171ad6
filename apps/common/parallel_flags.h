// dtp-generate's and dtp-serve's layout of the ranks: --ep, --cp,
// --cp-attention, --cp-layout (load_inference_model reads them).
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

struct InferenceParallelFlags {
  int64_t ep = 1, cp = 1;
  std::string cp_attention = "ring", cp_layout = "head-tail";

  models::ContextParallelOptions cp_options() const {
    models::ContextParallelOptions o;
    o.attention = cp_attention == "ring" ? models::ContextParallelAttention::Ring
                                         : models::ContextParallelAttention::AllToAll;
    o.layout = cp_layout == "head-tail" ? CpLayout::HeadTail : CpLayout::Contiguous;
    return o;
  }

  // ep borrows the cp ranks, as in dtp-train (NOTE: [Context parallelism
  // with expert parallelism] in src/models/llama_parallelize.cpp).
  void check() const {
    TORCH_CHECK(ep == 1 || cp == 1 || ep % cp == 0, "--ep ", ep, " with --cp ", cp, ": expert parallelism borrows "
                "the cp ranks (the experts spread over ep ranks that hold whole cp groups), so ep must be a "
                "multiple of cp. Use --ep ", cp, " or another multiple of ", cp, ".");
  }
};

inline void add_inference_parallel_flags(CLI::App& app, InferenceParallelFlags& f) {
  app.add_option("--ep", f.ep, "Expert-parallel degree for MoE models: each MoE layer's experts spread over ep "
                 "ranks, the rest tensor parallel over tp = ranks / ep. With --cp, ep borrows the cp ranks (a "
                 "multiple of cp, as dtp-train's)")
      ->check(kPositive)->capture_default_str();
  app.add_option("--cp", f.cp, "Context-parallel degree: a prompt's prefill spread over cp ranks by position (ring "
                 "or all-to-all attention), the KV cache then gathered on every rank and decode as without cp; the "
                 "ranks form a (cp, tp) mesh with tp = ranks / cp")
      ->check(kPositive)->capture_default_str();
  app.add_option("--cp-attention", f.cp_attention, "Prefill attention over the cp ranks: ring (any head count) or "
                 "all_to_all (Ulysses: heads per tp rank divisible by cp)")
      ->check(CLI::IsMember({"ring", "all_to_all"}))->capture_default_str();
  app.add_option("--cp-layout", f.cp_layout, "Prompt positions per cp rank: head-tail (two chunks, balanced causal "
                 "work) or contiguous")
      ->check(CLI::IsMember({"head-tail", "contiguous"}))->capture_default_str();
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
