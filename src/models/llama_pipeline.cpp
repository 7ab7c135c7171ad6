#include "dtp/models/llama_pipeline.h"

namespace dtp::models {

Llama llama_pipeline_stage(const Llama& model, int stage, int stages, std::vector<int64_t> first) {
  const LlamaConfig& c = model->config;
  TORCH_CHECK(c.with_embedding && c.with_head, "llama_pipeline_stage: the model is a stage already. Cut the whole model.");
  TORCH_CHECK(stages >= 1 && stage >= 0 && stage < stages, "llama_pipeline_stage: stage ", stage, " of ", stages,
              ". Give 0 <= stage < stages.");
  TORCH_CHECK(!c.tie_embeddings || stages == 1, "llama_pipeline_stage: NYI: tied embeddings across stages (the "
              "embedding is on the first stage, the head on the last). Train with tie_embeddings = false.");
  const int64_t L = c.n_layers;
  if (first.empty()) {
    TORCH_CHECK(L % stages == 0, "llama_pipeline_stage: ", L, " layers do not divide evenly across ", stages,
                " stages. Give the first layer of each stage (a split, e.g. {0, ", (L + stages - 1) / stages,
                ", ...}), or use a layer count that is a multiple of ", stages, ".");
    for (int s = 0; s < stages; ++s) first.push_back(s * L / stages);
  }
  TORCH_CHECK(static_cast<int>(first.size()) == stages && first[0] == 0, "llama_pipeline_stage: the split ",
              c10::IntArrayRef(first), " must give the first layer of each of the ", stages, " stages, starting at 0.");
  for (int s = 1; s < stages; ++s)
    TORCH_CHECK(first[s] >= first[s - 1] && first[s] <= L, "llama_pipeline_stage: the split ", c10::IntArrayRef(first),
                " is not non-decreasing within the model's ", L, " layers.");
  const int64_t begin = first[stage], end = stage + 1 < stages ? first[stage + 1] : L;

  LlamaConfig sc = c;
  sc.with_embedding = stage == 0;
  sc.with_head = stage == stages - 1;
  sc.n_layers = 0;           // the blocks are the model's, added below
  sc.deferred_init = true;   // nothing of its own to allocate or initialize
  Llama part(sc);
  if (sc.with_embedding) part->tok_embeddings = part->replace_module("tok_embeddings", model->tok_embeddings);
  for (int64_t i = begin; i < end; ++i) part->layers->push_back(model->layers->ptr(i));
  if (sc.with_head) {
    part->norm = part->replace_module("norm", model->norm);
    part->output = part->replace_module("output", model->output);
  }
  part->config.n_layers = end - begin;
  part->config.deferred_init = c.deferred_init;
  part->awaiting_init = model->awaiting_init;
  return part;
}

}  // namespace dtp::models
