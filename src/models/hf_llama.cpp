// Hugging Face Llama: names, config.json, the rotary row permutation. Loading
// and export are in hf_load.cpp and hf_save.cpp.
#include "dtp/models/hf_llama.h"

#include "dtp/dtensor.h"

#include "models/hf_common.h"
#include "models/json_fields.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <tuple>
#include <map>
#include <regex>

namespace dtp::models {

std::string hf_name(const std::string& fqn) {
  static const std::vector<std::pair<std::regex, std::string>> rules = {
      {std::regex(R"(^tok_embeddings\.weight$)"), "model.embed_tokens.weight"},
      {std::regex(R"(^layers\.(\d+)\.attention\.wq\.(weight|bias)$)"), "model.layers.$1.self_attn.q_proj.$2"},
      {std::regex(R"(^layers\.(\d+)\.attention\.wk\.(weight|bias)$)"), "model.layers.$1.self_attn.k_proj.$2"},
      {std::regex(R"(^layers\.(\d+)\.attention\.wv\.(weight|bias)$)"), "model.layers.$1.self_attn.v_proj.$2"},
      {std::regex(R"(^layers\.(\d+)\.attention\.wo\.(weight|bias)$)"), "model.layers.$1.self_attn.o_proj.$2"},
      {std::regex(R"(^layers\.(\d+)\.attention\.q_norm\.weight$)"), "model.layers.$1.self_attn.q_norm.weight"},
      {std::regex(R"(^layers\.(\d+)\.attention\.k_norm\.weight$)"), "model.layers.$1.self_attn.k_norm.weight"},
      {std::regex(R"(^layers\.(\d+)\.feed_forward\.w1\.weight$)"), "model.layers.$1.mlp.gate_proj.weight"},
      {std::regex(R"(^layers\.(\d+)\.feed_forward\.w3\.weight$)"), "model.layers.$1.mlp.up_proj.weight"},
      {std::regex(R"(^layers\.(\d+)\.feed_forward\.w2\.weight$)"), "model.layers.$1.mlp.down_proj.weight"},
      {std::regex(R"(^layers\.(\d+)\.moe\.shared_expert\.w1\.weight$)"), "model.layers.$1.mlp.shared_expert.gate_proj.weight"},
      {std::regex(R"(^layers\.(\d+)\.moe\.shared_expert\.w3\.weight$)"), "model.layers.$1.mlp.shared_expert.up_proj.weight"},
      {std::regex(R"(^layers\.(\d+)\.moe\.shared_expert\.w2\.weight$)"), "model.layers.$1.mlp.shared_expert.down_proj.weight"},
      {std::regex(R"(^layers\.(\d+)\.moe\.shared_expert_gate\.weight$)"), "model.layers.$1.mlp.shared_expert_gate.weight"},
      {std::regex(R"(^layers\.(\d+)\.attention_norm\.weight$)"), "model.layers.$1.input_layernorm.weight"},
      {std::regex(R"(^layers\.(\d+)\.ffn_norm\.weight$)"), "model.layers.$1.post_attention_layernorm.weight"},
      {std::regex(R"(^norm\.weight$)"), "model.norm.weight"},
      {std::regex(R"(^output\.weight$)"), "lm_head.weight"},
  };
  for (const auto& [re, to] : rules) {
    if (std::regex_match(fqn, re)) return std::regex_replace(fqn, re, to);
  }
  TORCH_CHECK(false, "hf_name: the Llama parameter '", fqn, "' has no Hugging Face name.");
}

namespace {

// HF's names of one MoE layer's tensors: the router, and per expert the
// SwiGLU matrices in the family's names (w1 the gate, w3 the up, w2 the down
// projection).
std::string moeName(const std::string& family, const std::string& layer, const std::string& what, int64_t e = -1) {
  const bool mixtral = family == "mixtral";
  const std::string base = "model.layers." + layer + (mixtral ? ".block_sparse_moe." : ".mlp.");
  if (what == "gate") return base + "gate.weight";
  const char* name = mixtral ? what.c_str() : what == "w1" ? "gate_proj" : what == "w3" ? "up_proj" : "down_proj";
  return base + "experts." + std::to_string(e) + "." + name + ".weight";
}

}  // namespace

std::vector<int64_t> hf_shape(const HFTensor& t) {
  auto shape = is_dtensor(t.param) ? dtensor_spec(t.param).shape : t.param.sizes().vec();
  if (t.expert >= 0) shape.erase(shape.begin());
  return shape;
}

std::vector<HFTensor> hf_tensors(Llama& model) {
  std::vector<HFTensor> out;
  const LlamaConfig& c = model->config;
  const int64_t hd = c.head_dim();
  // Rows in rotary order (NOTE: [Rotary layouts]): the q and k projections'
  // weights and biases, and the per-head q/k norms' weights.
  static const std::regex rotary(R"(\.attention\.(wq|wk|q_norm|k_norm)\.)");
  static const std::regex moe(R"(^layers\.(\d+)\.moe\.(gate\.weight|experts\.w1|experts\.w2|experts\.w3)$)");
  const auto params = model->unique_named_parameters();
  std::map<std::string, at::Tensor> by_name(params.begin(), params.end());
  for (auto& [fqn, p] : params) {
    std::smatch m;
    if (!std::regex_match(fqn, m, moe)) {
      out.push_back({fqn, hf_name(fqn), p, std::regex_search(fqn, rotary) ? hd : 0});
      continue;
    }
    const std::string layer = m[1];
    if (m[2] == "gate.weight") {
      out.push_back({fqn, moeName(c.family, layer, "gate"), p});
    } else if (m[2] == "experts.w1") {  // every expert's three matrices, in HF's order
      for (int64_t e = 0; e < c.moe.num_experts; ++e) {
        const bool mixtral = c.family == "mixtral";
        for (const char* w : {"w1", mixtral ? "w2" : "w3", mixtral ? "w3" : "w2"}) {
          const std::string stacked = "layers." + layer + ".moe.experts." + w;
          out.push_back({stacked, moeName(c.family, layer, w, e), by_name.at(stacked), 0, e});
        }
      }
    }
  }
  return out;
}

std::vector<RowRun> row_runs(int64_t offset, int64_t rows, int64_t hd) {
  if (rows == 0) return {};
  if (hd == 0) return {{0, 1, rows, offset}};
  std::vector<RowRun> runs;
  const int64_t end = offset + rows;
  for (int64_t h = offset / hd; h * hd < end; ++h) {
    const int64_t lo = std::max(offset, h * hd), hi = std::min(end, (h + 1) * hd);
    for (int64_t j = 0; j < 2; ++j) {
      int64_t r = lo + (((lo - h * hd) % 2) != j ? 1 : 0);  // first row of parity j
      if (r >= hi) continue;
      const int64_t count = (hi - 1 - r) / 2 + 1;
      runs.push_back({r - offset, 2, count, h * hd + j * (hd / 2) + (r - h * hd) / 2});
    }
  }
  return runs;
}

at::Tensor run_rows(const at::Tensor& local, const RowRun& run) {
  return local.slice(0, run.local_first, run.local_first + run.step * (run.count - 1) + 1, run.step);
}

namespace {

using Json = nlohmann::json;

constexpr const char* kApi = "llama_config_from_hf";

template <class T>
T field(const Json& j, const std::string& path, const char* key) {
  return json_field<T>(j, kApi, path, key);
}

template <class T>
T optional(const Json& j, const std::string& path, const char* key, T fallback) {
  return json_field_or<T>(j, kApi, path, key, fallback);
}

}  // namespace

// See NOTE: [Model families].
LlamaConfig llama_config_from_hf(const std::string& dir, int64_t max_seq_len) {
  const std::string path = dir + "/config.json";
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "llama_config_from_hf: cannot open '", path,
              "'. Pass a Hugging Face model folder (config.json and *.safetensors).");
  Json j;
  try {
    j = Json::parse(in);
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, "llama_config_from_hf: '", path, "' is not valid JSON: ", e.what());
  }
  TORCH_CHECK(j.is_object(), "llama_config_from_hf: '", path, "' is ", j.type_name(), ", expected a JSON object.");
  const std::string type = optional<std::string>(j, path, "model_type", "");
  TORCH_CHECK(type == "llama" || type == "mistral" || type == "qwen2" || type == "qwen3" || type == "mixtral" ||
                  type == "qwen2_moe" || type == "qwen3_moe",
              "llama_config_from_hf: '", path, "' has model_type '", type, "'. NYI: supported are \"llama\" (Llama "
              "1/2/3), \"mistral\", \"qwen2\" (Qwen 2.5), \"qwen3\", \"mixtral\", \"qwen2_moe\" and \"qwen3_moe\".");
  auto nyi = [&](const std::string& key, const Json& value, const std::string& why) {
    TORCH_CHECK(false, "llama_config_from_hf: NYI: '", path, "' sets ", key, "=", value.dump(), ": ", why, ".");
  };
  auto set = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
  LlamaConfig c;
  c.family = type;
  c.vocab_size = field<int64_t>(j, path, "vocab_size");
  c.dim = field<int64_t>(j, path, "hidden_size");
  c.ffn_hidden = field<int64_t>(j, path, "intermediate_size");
  c.n_layers = field<int64_t>(j, path, "num_hidden_layers");
  c.n_heads = field<int64_t>(j, path, "num_attention_heads");
  c.n_kv_heads = optional<int64_t>(j, path, "num_key_value_heads", c.n_heads);
  c.norm_eps = optional<double>(j, path, "rms_norm_eps", 1e-6);
  c.tie_embeddings = optional<bool>(j, path, "tie_word_embeddings", false);
  c.max_seq_len = max_seq_len > 0 ? max_seq_len : optional<int64_t>(j, path, "max_position_embeddings", 2048);
  c.explicit_head_dim = optional<int64_t>(j, path, "head_dim", 0);
  // Sizes by their key in the file, before LlamaConfig::validate names dtp's
  // field for them.
  for (const auto& [key, value, least] :
       {std::make_tuple("vocab_size", c.vocab_size, 1), std::make_tuple("hidden_size", c.dim, 1),
        std::make_tuple("intermediate_size", c.ffn_hidden, 1), std::make_tuple("num_hidden_layers", c.n_layers, 0),
        std::make_tuple("num_attention_heads", c.n_heads, 1), std::make_tuple("num_key_value_heads", c.n_kv_heads, 1),
        std::make_tuple("max_position_embeddings", c.max_seq_len, 1), std::make_tuple("head_dim", c.explicit_head_dim, 0)})
    TORCH_CHECK(value >= least, kApi, ": '", path, "': \"", key, "\" is ", value, ", expected an integer of ", least,
                " or more. Fix the value in the file.");
  if (c.explicit_head_dim > 0 && c.explicit_head_dim * c.n_heads == c.dim) c.explicit_head_dim = 0;  // the default
  const std::string act = optional<std::string>(j, path, "hidden_act", "silu");
  if (act != "silu") nyi("hidden_act", j["hidden_act"], "the MLP is SwiGLU (silu) in every supported family");
  if (optional<bool>(j, path, "mlp_bias", false)) nyi("mlp_bias", j["mlp_bias"], "the MLP projections have no bias");
  if (optional<double>(j, path, "partial_rotary_factor", 1.0) != 1.0)
    nyi("partial_rotary_factor", j["partial_rotary_factor"], "rotary embeddings cover the whole head");

  // Biases: Llama's and Qwen 3's attention_bias is all four projections;
  // Qwen 2.5 has q/k/v biases always and none on o, Qwen2-MoE q/k/v biases
  // as qkv_bias says (true unless set) and none on o.
  if (type == "qwen2") {
    c.qkv_bias = true;
  } else if (type == "qwen2_moe") {
    c.qkv_bias = optional<bool>(j, path, "qkv_bias", true);
  } else {
    c.qkv_bias = c.o_bias = optional<bool>(j, path, "attention_bias", false);
  }
  c.qk_norm = type == "qwen3" || type == "qwen3_moe";
  // Mixtures of experts: Mixtral's every block; Qwen2-MoE's and Qwen3-MoE's
  // every block unless decoder_sparse_step or mlp_only_layers say otherwise
  // (NYI).
  if (type == "mixtral") {
    c.moe.num_experts = field<int64_t>(j, path, "num_local_experts");
    c.moe.hidden = c.ffn_hidden;
    c.moe.norm_topk_prob = true;
  } else if (type == "qwen2_moe" || type == "qwen3_moe") {
    c.moe.num_experts = field<int64_t>(j, path, "num_experts");
    c.moe.hidden = field<int64_t>(j, path, "moe_intermediate_size");
    c.moe.norm_topk_prob = optional<bool>(j, path, "norm_topk_prob", false);
    if (optional<int64_t>(j, path, "decoder_sparse_step", 1) != 1)
      nyi("decoder_sparse_step", j["decoder_sparse_step"], "every block must be a mixture of experts (1)");
    if (set("mlp_only_layers") && !j["mlp_only_layers"].empty())
      nyi("mlp_only_layers", j["mlp_only_layers"], "every block must be a mixture of experts ([])");
    if (type == "qwen2_moe") {  // every block has a shared expert beside the routed ones
      c.moe.shared_hidden = field<int64_t>(j, path, "shared_expert_intermediate_size");
      TORCH_CHECK(c.moe.shared_hidden > 0, kApi, ": '", path, "': shared_expert_intermediate_size=",
                  c.moe.shared_hidden, " must be positive (qwen2_moe's shared expert). Fix the config.");
    }
  }
  if (c.moe.num_experts > 0) {
    c.moe.top_k = field<int64_t>(j, path, "num_experts_per_tok");
    c.moe.aux_loss_coef = optional<double>(j, path, "router_aux_loss_coef", 0.0);
    TORCH_CHECK(c.moe.top_k >= 1 && c.moe.top_k <= c.moe.num_experts, kApi, ": '", path, "': num_experts_per_tok=",
                c.moe.top_k, " must be in [1, ", c.moe.num_experts, "] (the number of experts). Fix the config.");
  }
  // Sliding windows: Mistral's applies to every layer when set; Qwen's only
  // under use_sliding_window, and then to some layers (max_window_layers).
  if (type == "mistral" || type == "mixtral") {
    c.sliding_window = optional<int64_t>(j, path, "sliding_window", 0);
  } else if (optional<bool>(j, path, "use_sliding_window", false)) {
    nyi("use_sliding_window", j["use_sliding_window"], "Qwen's per-layer sliding window (max_window_layers) is not "
        "implemented; the released Qwen 2.5 / Qwen 3 configs set it false");
  }
  if (set("layer_types")) {
    for (const auto& t : j["layer_types"]) {
      if (t != "full_attention") nyi("layer_types", j["layer_types"], "every layer must be \"full_attention\"");
    }
  }

  // Rotary embeddings: rope_theta and rope_scaling, or transformers 5's
  // rope_parameters holding both.
  const bool v5 = set("rope_parameters");
  const Json& rope = v5 ? j["rope_parameters"] : (set("rope_scaling") ? j["rope_scaling"] : Json());
  const std::string rope_key = v5 ? "rope_parameters" : "rope_scaling";
  c.rope_theta = v5 ? json_field_or<double>(rope, kApi, path + ": rope_parameters", "rope_theta", 10000.0)
                    : optional<double>(j, path, "rope_theta", 10000.0);
  if (!rope.is_null()) {
    TORCH_CHECK(rope.is_object(), kApi, ": '", path, "': \"", rope_key, "\" is ", rope.dump(), ", expected an object.");
    const std::string where = path + ": " + rope_key;
    std::string rope_type = json_field_or<std::string>(rope, kApi, where, "rope_type", "");
    if (rope_type.empty()) rope_type = json_field_or<std::string>(rope, kApi, where, "type", "default");
    if (rope_type == "llama3") {
      c.rope_scaling.factor = json_field<double>(rope, kApi, where, "factor");
      c.rope_scaling.low_freq_factor = json_field<double>(rope, kApi, where, "low_freq_factor");
      c.rope_scaling.high_freq_factor = json_field<double>(rope, kApi, where, "high_freq_factor");
      c.rope_scaling.original_max_position_embeddings =
          json_field<int64_t>(rope, kApi, where, "original_max_position_embeddings");
    } else if (rope_type != "default") {
      nyi(rope_key, rope, "rope_type \"" + rope_type + "\" is not implemented; supported are \"default\" and "
          "\"llama3\" (Llama 3.1+)");
    }
  }
  c.validate();
  return c;
}

}  // namespace dtp::models
