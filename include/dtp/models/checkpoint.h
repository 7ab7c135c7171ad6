// Checkpoints of the reference Llama and its AdamW state as one safetensors
// file of full (unsharded) tensors, so a run saved at one TP degree resumes at
// another. Every rank calls both functions; rank 0 writes (atomically: write,
// fsync, rename), every rank reads and keeps its shards.
#pragma once

#include "dtp/models/llama.h"

#include <torch/optim/adamw.h>

#include <string>

namespace dtp::models {

void save_checkpoint(const std::string& path, Llama& model, torch::optim::AdamW& optimizer, int64_t step);

// Returns the step the checkpoint was saved at. A file that is truncated,
// corrupt, or from a model of another shape is an error naming the file and
// the mismatch; nothing is changed then.
int64_t load_checkpoint(const std::string& path, Llama& model, torch::optim::AdamW* optimizer);

// NOTE: [Config in the checkpoint] dtp-train records the model's config in
// its checkpoints' metadata under kLlamaConfigKey, as JSON of the fields that
// fix the model (sizes, norm eps, rope theta, tied embeddings, dtype,
// max_seq_len), so that dtp-generate and --resume need only the folder.
constexpr const char* kLlamaConfigKey = "model.config";
std::string llama_config_to_json(const LlamaConfig& c);
// Errors name `where` and the key (missing, or of another type).
LlamaConfig llama_config_from_json(const std::string& text, const std::string& where);

}  // namespace dtp::models
