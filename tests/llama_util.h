// The small reference Llama that the model and checkpoint tests train: one
// config, the batch of each step, a plain training loop, and a run's trace
// (losses, final weights) compared against one device's.
#pragma once

#include "close.h"

#include "dtp/dtensor.h"
#include "dtp/models/llama.h"
#include "dtp/optim/adamw.h"

#include <torch/optim/adamw.h>

#include <functional>
#include <optional>
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

// `c` Mixtral-shaped: a MoE in every block, 4 experts of width 12, top 2,
// the routing weights renormalized.
inline models::LlamaConfig mixtral_like(models::LlamaConfig c) {
  c.family = "mixtral";
  c.moe.num_experts = 4;
  c.moe.top_k = 2;
  c.moe.hidden = 12;
  c.moe.norm_topk_prob = true;
  return c;
}

// The batch of step `step`, [kBatch, kSeq + 1]: the same whichever run or TP
// degree trains it.
inline at::Tensor llama_batch(int64_t vocab, int64_t step) {
  return at::remainder(at::arange(kBatch * (kSeq + 1), at::kLong) * 13 + step * 5, vocab).view({kBatch, kSeq + 1});
}

// Trains steps [from, to) and returns their losses. With dp > 1 each step
// trains rank dp_rank's rows of the batch, and the loss is that rank's.
inline std::vector<double> train_llama(models::Llama& model, torch::optim::AdamW& opt, int from, int to,
                                       int64_t dp = 1, int64_t dp_rank = 0) {
  std::vector<double> losses;
  for (int step = from; step < to; ++step) {
    at::Tensor batch = llama_batch(model->config.vocab_size, step).to(model->config.device);
    batch = batch.narrow(0, dp_rank * (batch.size(0) / dp), batch.size(0) / dp);
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

// Full (unsharded) copies of the gradients, in unique_parameters order; a
// collective under TP.
inline std::vector<at::Tensor> full_grads(models::Llama& model) {
  std::vector<at::Tensor> out;
  for (auto& p : model->unique_parameters()) out.push_back(is_dtensor(p) ? full_tensor(p.grad()) : p.grad().clone());
  return out;
}

// A training run: the loss of each step and the full parameters after the last.
struct Trace {
  std::vector<double> losses;
  std::vector<std::pair<std::string, at::Tensor>> params;  // full
};

// A loop that trains steps [from, to) and returns their losses, as train_llama.
using TrainLoop = std::function<std::vector<double>(models::Llama&, torch::optim::AdamW&, int from, int to)>;

// `steps` AdamW steps (lr 1e-2) of `loop` (none: train_llama on the whole batch).
inline Trace train_trace(models::Llama& model, int steps, const TrainLoop& loop = {}) {
  dtp::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
  Trace t;
  t.losses = loop ? loop(model, opt, 0, steps) : train_llama(model, opt, 0, steps);
  t.params = full_named_params(model);
  return t;
}

// `got` trained like `want`: each loss within loss_tol (nullopt: losses not
// compared), the same parameter names in the same order, each parameter
// within param_tol of want's everywhere. The tolerances are the callers' (see
// NOTE: [Float64 parity tolerance] in llama_test.cpp).
inline void expect_same_trace(const Trace& got, const Trace& want, std::optional<double> loss_tol, double param_tol) {
  if (loss_tol) {
    ASSERT_EQ(got.losses.size(), want.losses.size());
    for (size_t i = 0; i < got.losses.size(); ++i) EXPECT_NEAR(got.losses[i], want.losses[i], *loss_tol) << "step " << i;
  }
  ASSERT_EQ(got.params.size(), want.params.size());
  for (size_t i = 0; i < got.params.size(); ++i) {
    EXPECT_EQ(got.params[i].first, want.params[i].first);
    EXPECT_CLOSE(got.params[i].second, want.params[i].second, 0.0, param_tol) << got.params[i].first;
  }
}

}  // namespace dtp::test
