// --resume / --checkpoint DIR in dtp-train and dtp-generate: the checkpoint
// the folder names (its newest complete step-<N>/, NOTE in
// include/dtp/dcp/step_folders.h) and the model config it records (NOTE:
// [Config in the checkpoint]), against which the model flags the user gave
// are checked: a flag that contradicts it is an error naming both values.
#pragma once

#include "model_flags.h"

#include "dtp/dcp/step_folders.h"
#include "dtp/models/checkpoint.h"

#include <cstdio>
#include <optional>

namespace dtp::apps {

struct SavedCheckpoint {
  std::string path;                          // the folder to load
  std::optional<models::LlamaConfig> config;  // none in checkpoints of older dtp-train runs
};

// Every rank calls it; `log`: print the step folders passed over.
inline SavedCheckpoint find_saved_checkpoint(const std::string& dir, bool log) {
  const dcp::FoundCheckpoint found = dcp::find_checkpoint(dir);
  if (log) {
    for (const auto& line : found.skipped) std::printf("%s\n", line.c_str());
  }
  SavedCheckpoint out{found.path, std::nullopt};
  auto it = found.metadata.find(models::kLlamaConfigKey);
  if (it != found.metadata.end()) out.config = models::llama_config_from_json(it->second, found.path);
  return out;
}

// Checks each model flag given on the command line against `saved`, then
// sets every model flag to the saved value.
inline void adopt_saved_config(const CLI::App& app, ModelFlags& f, const models::LlamaConfig& saved,
                               const std::string& where) {
  auto check = [&](const char* flag, int64_t given, int64_t value) {
    TORCH_CHECK(app.count(flag) == 0 || given == value, flag, " ", given, " contradicts the checkpoint '", where,
                "', saved with ", flag + 2, " ", value, ". Drop ", flag, ": the checkpoint's config is used.");
  };
  check("--dim", f.dim, saved.dim);
  check("--layers", f.layers, saved.n_layers);
  check("--heads", f.heads, saved.n_heads);
  check("--kv-heads", f.kv_heads, saved.n_kv_heads);
  check("--ffn", config_of(f, saved.max_seq_len, 0.0, 0).hidden(), saved.hidden());
  const std::string dtype = saved.dtype == c10::ScalarType::Double ? "float64" : "float32";
  TORCH_CHECK(app.count("--dtype") == 0 || f.dtype == dtype, "--dtype ", f.dtype, " contradicts the checkpoint '",
              where, "', saved in ", dtype, ". Drop --dtype: the checkpoint's config is used.");
  TORCH_CHECK(app.count("--tie-embeddings") == 0 || saved.tie_embeddings, "--tie-embeddings contradicts the "
              "checkpoint '", where, "', saved with untied embeddings. Drop --tie-embeddings.");
  f.dim = saved.dim;
  f.layers = saved.n_layers;
  f.heads = saved.n_heads;
  f.kv_heads = saved.n_kv_heads;
  f.ffn = saved.hidden();
  f.tie = saved.tie_embeddings;
  f.dtype = dtype;
}

}  // namespace dtp::apps
