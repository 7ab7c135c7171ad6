#include "dtp/models/engine_model.h"

#include "dtp/dtensor.h"
#include "dtp/inference/kv_cache.h"
#include "models/llama_cp.h"

namespace dtp::models {
namespace {

class LlamaEngineModel final : public inference::Model {
 public:
  explicit LlamaEngineModel(Llama& model) : model_(model) {}

  at::Tensor forward(const at::Tensor& tokens, KVCache& cache, const std::vector<int64_t>& valid) override {
    // See NOTE: [Context-parallel prefill] in src/models/llama_cp_prefill.cpp.
    if (model_->context_parallel) {
      bool over_cp = false;
      at::Tensor logits = detail::context_parallel_cached_forward(model_, tokens, cache, valid, &over_cp);
      prefills_ += over_cp;
      return logits;
    }
    return model_->forward(tokens, cache, valid);
  }

  // The model's KV heads on this rank. With KV heads sharded unevenly
  // (torch.chunk: 3 heads over 2 ranks -> 2, 1) every rank sizes its pool by
  // the largest share, so that every rank holds as many blocks.
  inference::KvShape kv_shape() const override {
    auto* block = model_->layers->ptr(0)->as<nn::HookedImpl<TransformerBlockImpl>>();
    TORCH_CHECK(block != nullptr, "models::engine_model: the model has no transformer blocks: got 0 layers, expected "
                "at least 1.");
    const auto& attention = block->attention;
    const at::Tensor wk = attention->wk->weight;
    inference::KvShape s;
    s.layers = model_->config.n_layers;
    s.head_dim = attention->head_dim;
    s.dtype = model_->config.dtype;
    s.device = model_->config.device;
    if (attention->kv_head >= 0) {  // fewer KV heads than ranks: one each
      s.local_heads = s.largest_share = 1;
    } else if (!is_dtensor(wk)) {
      s.local_heads = s.largest_share = wk.size(0) / s.head_dim;
    } else {
      const int64_t heads = wk.size(0) / s.head_dim, tp = device_mesh(wk).size();
      s.local_heads = to_local(wk).size(0) / s.head_dim;
      s.largest_share = (heads + tp - 1) / tp;
    }
    return s;
  }

  int64_t vocab_size() const override { return model_->config.vocab_size; }
  int64_t max_seq_len() const override { return model_->config.max_seq_len; }
  int64_t context_parallel_prefills() const override { return prefills_; }
  // ContextParallelOptions::kv_cache == Sharded: the blocks over the cp group.
  ProcessGroup kv_cache_group() const override {
    const auto& cp = model_->context_parallel;
    return cp && cp->shard_kv_cache ? cp->group : ProcessGroup();
  }

 private:
  Llama& model_;
  int64_t prefills_ = 0;  // forwards that prefilled over cp
};

}  // namespace

std::shared_ptr<inference::Model> engine_model(Llama& model) { return std::make_shared<LlamaEngineModel>(model); }

}  // namespace dtp::models
