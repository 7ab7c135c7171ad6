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
  const std::string dtype = json_field<std::string>(j, kApi, where, "dtype");
  TORCH_CHECK(dtype == "Float" || dtype == "Double", kApi, ": '", where, "': \"dtype\" is '", dtype,
              "', expected Float or Double.");
  c.dtype = dtype == "Double" ? c10::ScalarType::Double : c10::ScalarType::Float;
  c.validate();
  return c;
}

}  // namespace dtp::models
