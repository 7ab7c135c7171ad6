// See NOTE: [Config in the checkpoint] in include/dtp/models/checkpoint.h.
#include "dtp/models/checkpoint.h"

#include "models/json_fields.h"

namespace dtp::models {
namespace {

constexpr const char* kApi = "llama_config_from_json";

}  // namespace

std::string llama_config_to_json(const LlamaConfig& c) {
  nlohmann::json j = {{"vocab_size", c.vocab_size},     {"dim", c.dim},
                      {"n_layers", c.n_layers},         {"n_heads", c.n_heads},
                      {"n_kv_heads", c.n_kv_heads},     {"ffn_hidden", c.hidden()},
                      {"max_seq_len", c.max_seq_len},   {"norm_eps", c.norm_eps},
                      {"rope_theta", c.rope_theta},     {"tie_embeddings", c.tie_embeddings},
                      {"dtype", c10::toString(c.dtype)}};
  // See NOTE: [Model families]; absent in checkpoints written before them.
  j["family"] = c.family;
  j["head_dim"] = c.head_dim();
  j["qkv_bias"] = c.qkv_bias;
  j["o_bias"] = c.o_bias;
  j["qk_norm"] = c.qk_norm;
  j["sliding_window"] = c.sliding_window;
  j["rope_scaling"] = {{"factor", c.rope_scaling.factor},
                       {"low_freq_factor", c.rope_scaling.low_freq_factor},
                       {"high_freq_factor", c.rope_scaling.high_freq_factor},
                       {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
  if (c.moe.num_experts > 0) {
    j["moe"] = {{"num_experts", c.moe.num_experts}, {"top_k", c.moe.top_k},       {"hidden", c.moe.hidden},
                {"norm_topk_prob", c.moe.norm_topk_prob}, {"aux_loss_coef", c.moe.aux_loss_coef}};
    if (c.moe.shared_hidden > 0) j["moe"]["shared_hidden"] = c.moe.shared_hidden;
  }
  return j.dump();
}

LlamaConfig llama_config_from_json(const std::string& text, const std::string& where) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, kApi, ": the config recorded in '", where, "' is not valid JSON (", e.what(),
                "). The checkpoint's index is corrupt.");
  }
  TORCH_CHECK(j.is_object(), kApi, ": the config recorded in '", where, "' is ", j.type_name(), ", expected an object.");
  LlamaConfig c;
  c.vocab_size = json_field<int64_t>(j, kApi, where, "vocab_size");
  c.dim = json_field<int64_t>(j, kApi, where, "dim");
  c.n_layers = json_field<int64_t>(j, kApi, where, "n_layers");
  c.n_heads = json_field<int64_t>(j, kApi, where, "n_heads");
  c.n_kv_heads = json_field<int64_t>(j, kApi, where, "n_kv_heads");
  c.ffn_hidden = json_field<int64_t>(j, kApi, where, "ffn_hidden");
  c.max_seq_len = json_field<int64_t>(j, kApi, where, "max_seq_len");
  c.norm_eps = json_field<double>(j, kApi, where, "norm_eps");
  c.rope_theta = json_field<double>(j, kApi, where, "rope_theta");
  c.tie_embeddings = json_field<bool>(j, kApi, where, "tie_embeddings");
  c.family = json_field_or<std::string>(j, kApi, where, "family", "llama");
  const int64_t head_dim = json_field_or<int64_t>(j, kApi, where, "head_dim", 0);
  if (head_dim * c.n_heads != c.dim) c.explicit_head_dim = head_dim;
  c.qkv_bias = json_field_or<bool>(j, kApi, where, "qkv_bias", false);
  c.o_bias = json_field_or<bool>(j, kApi, where, "o_bias", false);
  c.qk_norm = json_field_or<bool>(j, kApi, where, "qk_norm", false);
  c.sliding_window = json_field_or<int64_t>(j, kApi, where, "sliding_window", 0);
  if (j.contains("rope_scaling")) {
    const std::string at = where + ": rope_scaling";
    const auto& r = j["rope_scaling"];
    c.rope_scaling.factor = json_field<double>(r, kApi, at, "factor");
    c.rope_scaling.low_freq_factor = json_field<double>(r, kApi, at, "low_freq_factor");
    c.rope_scaling.high_freq_factor = json_field<double>(r, kApi, at, "high_freq_factor");
    c.rope_scaling.original_max_position_embeddings = json_field<int64_t>(r, kApi, at, "original_max_position_embeddings");
  }
  if (j.contains("moe")) {
    const std::string at = where + ": moe";
    const auto& m = j["moe"];
    c.moe.num_experts = json_field<int64_t>(m, kApi, at, "num_experts");
    c.moe.top_k = json_field<int64_t>(m, kApi, at, "top_k");
    c.moe.hidden = json_field<int64_t>(m, kApi, at, "hidden");
    c.moe.norm_topk_prob = json_field<bool>(m, kApi, at, "norm_topk_prob");
    c.moe.aux_loss_coef = json_field<double>(m, kApi, at, "aux_loss_coef");
    c.moe.shared_hidden = json_field_or<int64_t>(m, kApi, at, "shared_hidden", 0);
  }
  const std::string dtype = json_field<std::string>(j, kApi, where, "dtype");
  TORCH_CHECK(dtype == "Float" || dtype == "Double", kApi, ": '", where, "': \"dtype\" is '", dtype,
              "', expected Float or Double.");
  c.dtype = dtype == "Double" ? c10::ScalarType::Double : c10::ScalarType::Float;
  c.validate();
  return c;
}

}  // namespace dtp::models
