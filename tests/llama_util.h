// The small reference Llama that the model and checkpoint tests train: one
// config, the batch of each step, and a plain training loop.
#pragma once

#include "dtp/dtensor.h"
#include "dtp/models/llama.h"

#include <torch/optim/adamw.h>

#include <string>
#include <utility>
#include <vector>

namespace dtp::test {

constexpr int64_t kBatch = 2, kSeq = 8;

// Uneven vocabulary over 2 and 4 ranks; kv heads divisible by `tp`.
inline models::LlamaConfig small_llama_config(int tp = 2) {
  models::LlamaConfig c;
  c.vocab_size = 67;
  c.dim = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = tp == 4 ? 4 : 2;
  c.ffn_hidden = 40;  // 10 per rank on 4 ranks
  c.max_seq_len = 16;
  c.seed = 7;
  return c;
}

// The batch of step `step`, [kBatch, kSeq + 1]: the same whichever run or TP
// degree trains it.
inline at::Tensor llama_batch(int64_t vocab, int64_t step) {
  return at::remainder(at::arange(kBatch * (kSeq + 1), at::kLong) * 13 + step * 5, vocab).view({kBatch, kSeq + 1});
}

// Trains steps [from, to) and returns their losses.
inline std::vector<double> train_llama(models::Llama& model, torch::optim::AdamW& opt, int from, int to) {
  std::vector<double> losses;
  for (int step = from; step < to; ++step) {
    at::Tensor batch = llama_batch(model->config.vocab_size, step).to(model->config.device);
    at::Tensor loss = models::llama_loss(model(batch.narrow(1, 0, kSeq)), batch.narrow(1, 1, kSeq));
    opt.zero_grad();
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

// Full (unsharded) copies of the parameters, by name; a collective under TP.
inline std::vector<std::pair<std::string, at::Tensor>> full_named_params(models::Llama& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& [name, p] : model->unique_named_parameters())
    out.emplace_back(name, is_dtensor(p) ? full_tensor(p.detach()) : p.detach().clone());
  return out;
}

}  // namespace dtp::test
