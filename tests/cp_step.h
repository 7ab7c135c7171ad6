// What the context-parallel training tests share (cp_llama_test.cpp,
// cp_pipeline_test.cpp, cp_moe_test.cpp): the token batch, one device's step
// on it, the data loader's cut of rows, and the comparison of a rank's step
// with one device's.
#pragma once

#include "dtp/dtensor.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/process_group.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace dtp::test {

constexpr int64_t kCpBatch = 4;  // rows per step

// [kCpBatch, seq + 1] tokens from a generator seeded `seed + seq`: the inputs
// are the first seq columns, the labels the last seq.
inline at::Tensor cp_batch(int64_t vocab, int64_t seq, uint64_t seed) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed + seq);
  return at::randint(vocab, {kCpBatch, seq + 1}, g, at::kLong);
}

// The rows data-parallel rank dp.rank() trains on: all of them without dp.
// Never cut over cp: cp ranks share rows and split positions.
inline at::Tensor cp_rows(const at::Tensor& batch, const ProcessGroup& dp) {
  if (!dp.valid()) return batch;
  return batch.narrow(0, dp.rank() * (kCpBatch / dp.size()), kCpBatch / dp.size());
}

struct CpStep {
  double loss = 0;
  std::map<std::string, at::Tensor> grads;  // full, by the whole model's names
};

// One device's step on `batch`: the mean over every token (plus every
// layer's load-balancing loss when `aux`), and every parameter's gradient.
inline CpStep cp_one_device_step(const models::LlamaConfig& c, const at::Tensor& batch, bool aux = false) {
  models::Llama model(c);
  const int64_t seq = batch.size(1) - 1;
  at::Tensor loss = models::llama_loss(model(batch.narrow(1, 0, seq)), batch.narrow(1, 1, seq));
  if (aux) loss = loss + models::moe_load_balancing_loss(model);  // after the forward
  loss.backward();
  CpStep out;
  out.loss = loss.item<double>();
  for (auto& [name, p] : model->unique_named_parameters()) out.grads[name] = p.grad().clone();
  return out;
}

// One rank's step against one device's, each within `tol`: the loss (each
// rank's weighted share, summed over the world and divided by `sharers`, the
// ranks whose shares make one batch's loss; an undefined `loss`, a pipeline
// rank without the last stage, adds 0) and the full gradient of each of
// `params` (the whole model's names). A collective over the world: every
// rank calls it. Returns the largest difference.
inline double expect_cp_step_equals(const at::Tensor& loss, int64_t sharers,
                                    const std::vector<std::pair<std::string, at::Tensor>>& params,
                                    const CpStep& want, double tol) {
  const at::Tensor mine = loss.defined() ? (is_dtensor(loss) ? full_tensor(loss.detach()) : loss.detach())
                                         : at::zeros({}, at::kDouble);
  const double got = default_process_group().all_reduce(mine.reshape({1}).clone()).wait().item<double>() /
                     static_cast<double>(sharers);
  double err = std::abs(got - want.loss);
  EXPECT_LE(err, tol) << "loss " << got << " vs one device " << want.loss;
  EXPECT_FALSE(params.empty()) << "no parameter to compare";
  for (const auto& [name, p] : params) {
    EXPECT_TRUE(p.grad().defined()) << "no gradient for " << name;
    if (!p.grad().defined()) continue;
    const at::Tensor g = is_dtensor(p) ? full_tensor(p.grad()) : p.grad();
    const double d = (g - want.grads.at(name)).abs().max().item<double>();
    EXPECT_LE(d, tol) << "gradient of " << name;
    err = std::max(err, d);
  }
  return err;
}

// Ring attention (the default) in a layout, and all-to-all attention.
inline models::ContextParallelOptions cp_ring(CpLayout layout = CpLayout::HeadTail) {
  models::ContextParallelOptions o;
  o.layout = layout;
  return o;
}
inline models::ContextParallelOptions cp_all_to_all(CpLayout layout = CpLayout::HeadTail) {
  models::ContextParallelOptions o;
  o.attention = models::ContextParallelAttention::AllToAll;
  o.layout = layout;
  return o;
}

}  // namespace dtp::test
