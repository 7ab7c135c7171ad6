// Model-size flags shared by dtp-train and dtp-generate (a checkpoint loads
// only into a model of the same shape).
#pragma once

#include "checks.h"
#include "dtp/models/llama.h"
#include "dtp/nn/quantize.h"

#include <CLI/CLI.hpp>

#include <optional>
#include <string>

namespace dtp::apps {

struct ModelFlags {
  int64_t dim = 128, layers = 2, heads = 4, kv_heads = 2, ffn = 0;
  int64_t experts = 0, top_k = 2, expert_ffn = 0;  // experts > 0: Mixtral-style MoE blocks
  int64_t shared_expert_ffn = 0;                   // > 0: with a gated shared expert (Qwen2-MoE)
  double aux_loss_coef = 0.01;
  bool tie = false;
  std::string dtype = "float32";
  // dtp-generate / dtp-serve: the Linear weights' storage (NOTE: [Weight-only linears]).
  std::string quantize = "none";
  int64_t quantize_group = 32;
  std::string quantize_scales = "float16";
};

// The computation's dtype: float64, else float32 (--dtype bfloat16 / float16
// store the Linear weights narrow and compute in float32: weight_only_of).
inline c10::ScalarType dtype_of(const std::string& name) {
  return name == "float64" ? c10::ScalarType::Double : c10::ScalarType::Float;
}

// How the Linear weights are stored: --quantize int8, else --dtype bfloat16
// / float16; nullopt: in the model's dtype.
inline std::optional<nn::WeightOnlyOptions> weight_only_of(const ModelFlags& f) {
  if (f.quantize != "none") {
    return nn::weight_only_options(f.quantize, f.quantize_group)
        .scale_dtype(f.quantize_scales == "float32" ? c10::ScalarType::Float : c10::ScalarType::Half);
  }
  if (f.dtype == "bfloat16" || f.dtype == "float16") return nn::weight_only_options(f.dtype);
  return std::nullopt;
}

// --dtype (float32, float64, bfloat16, float16), --quantize,
// --quantize-group and --quantize-scales: the weights' storage of
// dtp-generate, dtp-serve and dtp-bench --decode (weight_only_of reads them).
inline void add_weight_format_flags(CLI::App& app, ModelFlags& f) {
  app.add_option("--dtype", f.dtype, "Parameters and activations: float32, or float64 for exact parity checks; "
                 "bfloat16 or float16: the Linear weights stored so (a --hf folder's cast at load), the rest and "
                 "the computation float32")
      ->check(CLI::IsMember({"float32", "float64", "bfloat16", "float16"}));
  app.add_option("--quantize", f.quantize, "int8: weight-only int8 Linear weights, quantized at load (one scale "
                 "per --quantize-group inputs of each row, llama.cpp's Q8_0 at 32), computing in --dtype")
      ->check(CLI::IsMember({"none", "int8"}))->capture_default_str();
  app.add_option("--quantize-group", f.quantize_group, "Inputs per int8 scale along each row; 0: one scale per "
                 "output row (torchao's int8_weight_only). Under TP each rank's share of a row must be a multiple "
                 "of it")->check(apps::kNonNegative)->capture_default_str();
  app.add_option("--quantize-scales", f.quantize_scales, "The int8 scales' dtype: float16 (Q8_0's, rounded up), or "
                 "float32 for weights beyond float16's range")
      ->check(CLI::IsMember({"float16", "float32"}))->capture_default_str();
}

// `inference` (dtp-generate, dtp-serve): --dtype also takes bfloat16 and
// float16, and --quantize / --quantize-group are added.
inline void add_model_flags(CLI::App& app, ModelFlags& f, bool inference = false) {
  app.add_option("--dim", f.dim, "Model width")->check(apps::kPositive);
  app.add_option("--layers", f.layers, "Transformer blocks")->check(apps::kNonNegative);
  app.add_option("--heads", f.heads, "Attention heads")->check(apps::kPositive);
  app.add_option("--kv-heads", f.kv_heads, "Key/value heads (grouped-query attention)")->check(apps::kPositive);
  app.add_option("--ffn", f.ffn, "MLP hidden size [default: SwiGLU's 8/3 dim]")->check(apps::kNonNegative);
  app.add_flag("--tie-embeddings", f.tie, "Share the embedding and output weights");
  if (!inference) {
    app.add_option("--dtype", f.dtype, "Parameters and activations: float32, or float64 for exact parity checks")
        ->check(CLI::IsMember({"float32", "float64"}));
    return;
  }
  add_weight_format_flags(app, f);
}

// dtp-train's mixture-of-experts flags (dtp-generate's --top-k samples).
inline void add_moe_flags(CLI::App& app, ModelFlags& f) {
  CLI::Option* experts = app.add_option("--experts", f.experts, "Mixture of experts in every block (Mixtral's "
                                        "routing) [default: 0, a dense MLP]")->check(apps::kNonNegative);
  app.add_option("--top-k", f.top_k, "Experts per token (--experts)")->check(apps::kPositive);
  app.add_option("--expert-ffn", f.expert_ffn, "Each expert's hidden size [default: --ffn's]")->check(apps::kNonNegative);
  app.add_option("--shared-expert-ffn", f.shared_expert_ffn, "A gated shared expert of this hidden size in every "
                 "MoE block, as Qwen2-MoE's (--experts) [default: 0, none]")->check(apps::kNonNegative)->needs(experts);
  app.add_option("--aux-loss-coef", f.aux_loss_coef, "Weight of the MoE load-balancing loss added in training "
                 "(--experts; not under --pp)")->check(apps::kNonNegative)->capture_default_str();
}

inline models::LlamaConfig config_of(const ModelFlags& f, int64_t seq, double dropout, uint64_t seed) {
  models::LlamaConfig c;
  c.dim = f.dim;
  c.n_layers = f.layers;
  c.n_heads = f.heads;
  c.n_kv_heads = f.kv_heads;
  c.ffn_hidden = f.ffn;
  c.max_seq_len = seq;
  c.dropout = dropout;
  c.tie_embeddings = f.tie;
  c.seed = seed;
  c.dtype = dtype_of(f.dtype);
  if (f.experts > 0) {
    c.family = "mixtral";
    c.moe.num_experts = f.experts;
    c.moe.top_k = f.top_k;
    c.moe.hidden = f.expert_ffn > 0 ? f.expert_ffn : c.hidden();
    c.moe.aux_loss_coef = f.aux_loss_coef;
    c.moe.shared_hidden = f.shared_expert_ffn;
    if (f.shared_expert_ffn > 0) c.family = "qwen2_moe";  // its routing (norm_topk_prob) is Mixtral's here
  }
  return c;
}

}  // namespace dtp::apps
