// Hugging Face Llama: names, config.json, the rotary row permutation. Loading
// and export are in hf_load.cpp and hf_save.cpp.
#include "dtp/models/hf_llama.h"

#include "models/hf_common.h"
#include "models/json_fields.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <regex>

namespace dtp::models {

std::string hf_name(const std::string& fqn) {
  static const std::vector<std::pair<std::regex, std::string>> rules = {
      {std::regex(R"(^tok_embeddings\.weight$)"), "model.embed_tokens.weight"},
      {std::regex(R"(^layers\.(\d+)\.attention\.wq\.weight$)"), "model.layers.$1.self_attn.q_proj.weight"},
      {std::regex(R"(^layers\.(\d+)\.attention\.wk\.weight$)"), "model.layers.$1.self_attn.k_proj.weight"},
      {std::regex(R"(^layers\.(\d+)\.attention\.wv\.weight$)"), "model.layers.$1.self_attn.v_proj.weight"},
      {std::regex(R"(^layers\.(\d+)\.attention\.wo\.weight$)"), "model.layers.$1.self_attn.o_proj.weight"},
      {std::regex(R"(^layers\.(\d+)\.feed_forward\.w1\.weight$)"), "model.layers.$1.mlp.gate_proj.weight"},
      {std::regex(R"(^layers\.(\d+)\.feed_forward\.w3\.weight$)"), "model.layers.$1.mlp.up_proj.weight"},
      {std::regex(R"(^layers\.(\d+)\.feed_forward\.w2\.weight$)"), "model.layers.$1.mlp.down_proj.weight"},
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

std::vector<HFTensor> hf_tensors(Llama& model) {
  std::vector<HFTensor> out;
  const int64_t hd = model->config.head_dim();
  for (auto& [fqn, p] : model->unique_named_parameters()) {
    const bool rope = fqn.find(".attention.wq.") != std::string::npos || fqn.find(".attention.wk.") != std::string::npos;
    out.push_back({fqn, hf_name(fqn), p, rope ? hd : 0});
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
  TORCH_CHECK(type == "llama", "llama_config_from_hf: '", path, "' has model_type '", type,
              "'. NYI: only \"llama\" (LlamaForCausalLM) folders are supported.");
  auto nyi = [&](const char* key, const std::string& why) {
    TORCH_CHECK(false, "llama_config_from_hf: NYI: '", path, "' sets ", key, "=", j.at(key).dump(), ": ", why, ".");
  };
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    nyi("rope_scaling", "dtp's rotary embedding has no scaling (Llama 3.1's \"llama3\", linear, dynamic, yarn)");
  }
  if (optional<bool>(j, path, "attention_bias", false)) nyi("attention_bias", "the reference Llama's projections have no bias");
  if (optional<bool>(j, path, "mlp_bias", false)) nyi("mlp_bias", "the reference Llama's MLP has no bias");
  if (j.contains("hidden_act") && j["hidden_act"] != "silu") nyi("hidden_act", "the reference Llama's MLP is SwiGLU (silu)");
  LlamaConfig c;
  c.vocab_size = field<int64_t>(j, path, "vocab_size");
  c.dim = field<int64_t>(j, path, "hidden_size");
  c.ffn_hidden = field<int64_t>(j, path, "intermediate_size");
  c.n_layers = field<int64_t>(j, path, "num_hidden_layers");
  c.n_heads = field<int64_t>(j, path, "num_attention_heads");
  c.n_kv_heads = optional<int64_t>(j, path, "num_key_value_heads", c.n_heads);
  c.norm_eps = optional<double>(j, path, "rms_norm_eps", 1e-6);
  c.rope_theta = optional<double>(j, path, "rope_theta", 10000.0);
  c.tie_embeddings = optional<bool>(j, path, "tie_word_embeddings", false);
  c.max_seq_len = max_seq_len > 0 ? max_seq_len : optional<int64_t>(j, path, "max_position_embeddings", 2048);
  const int64_t head_dim = optional<int64_t>(j, path, "head_dim", c.dim / std::max<int64_t>(c.n_heads, 1));
  if (head_dim * c.n_heads != c.dim) nyi("head_dim", "dtp's attention needs head_dim = hidden_size / num_attention_heads");
  c.validate();
  return c;
}

}  // namespace dtp::models
