#include "engine.h"

#include "dtp/dtensor.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cstring>

namespace dtp::serve {
namespace {

constexpr int64_t kBlock = 512;  // integers of a plan's first broadcast

int64_t bitsOf(double d) {
  int64_t i;
  std::memcpy(&i, &d, sizeof(i));
  return i;
}

double doubleOf(int64_t i) {
  double d;
  std::memcpy(&d, &i, sizeof(d));
  return d;
}

// Rows `idx` of logits [B, 1, V], plain or sharded on V, keeping the layout.
at::Tensor selectRows(const at::Tensor& logits, const std::vector<int64_t>& idx) {
  const at::Tensor index = at::tensor(idx, at::kLong);
  if (!is_dtensor(logits)) return logits.index_select(0, index.to(logits.device()));
  const at::Tensor local = to_local(logits);
  const at::Tensor rows = local.index_select(0, index.to(local.device()));
  return from_local(rows, device_mesh(logits), placements(logits), /*run_check=*/false,
                    std::vector<int64_t>{static_cast<int64_t>(idx.size()), logits.size(1), logits.size(2)});
}

}  // namespace

std::vector<int64_t> encode_plan(const StepPlan& p) {
  TORCH_INTERNAL_ASSERT(p.keep.size() == p.tokens.size());
  std::vector<int64_t> d = {p.op, static_cast<int64_t>(p.keep.size()), static_cast<int64_t>(p.admit.size())};
  d.insert(d.end(), p.keep.begin(), p.keep.end());
  d.insert(d.end(), p.tokens.begin(), p.tokens.end());
  for (const Admission& a : p.admit) {
    d.insert(d.end(), {a.id, static_cast<int64_t>(a.sampling.seed), bitsOf(a.sampling.options.temperature),
                       a.sampling.options.top_k, bitsOf(a.sampling.options.top_p),
                       static_cast<int64_t>(a.prompt.size())});
    d.insert(d.end(), a.prompt.begin(), a.prompt.end());
  }
  return d;
}

StepPlan decode_plan(const std::vector<int64_t>& d) {
  StepPlan p;
  size_t i = 0;
  auto next = [&]() {
    TORCH_CHECK(i < d.size(), "dtp-serve: a step plan of ", d.size(), " integers ends early: got a truncated plan, "
                "expected a whole one. Ranks must run the same dtp-serve build.");
    return d[i++];
  };
  p.op = next();
  const int64_t keep = next(), admit = next();
  for (int64_t k = 0; k < keep; ++k) p.keep.push_back(next());
  for (int64_t k = 0; k < keep; ++k) p.tokens.push_back(next());
  for (int64_t k = 0; k < admit; ++k) {
    Admission a;
    a.id = next();
    a.sampling.seed = static_cast<uint64_t>(next());
    a.sampling.options.temperature = doubleOf(next());
    a.sampling.options.top_k = next();
    a.sampling.options.top_p = doubleOf(next());
    const int64_t n = next();
    for (int64_t t = 0; t < n; ++t) a.prompt.push_back(next());
    p.admit.push_back(std::move(a));
  }
  return p;
}

StepPlan broadcast_plan(const std::optional<ProcessGroup>& group, const StepPlan& plan) {
  if (!group || group->size() == 1) return plan;
  std::vector<int64_t> data;
  if (group->rank() == 0) data = encode_plan(plan);
  // [length, first kBlock - 1 integers]; the rest, if any, in a second broadcast.
  at::Tensor head = at::zeros({kBlock}, at::kLong);
  if (group->rank() == 0) {
    head[0] = static_cast<int64_t>(data.size());
    const int64_t n = std::min<int64_t>(data.size(), kBlock - 1);
    std::copy(data.begin(), data.begin() + n, head.data_ptr<int64_t>() + 1);
  }
  group->broadcast(head, /*src=*/0);
  const int64_t total = head[0].item<int64_t>();
  if (group->rank() != 0) {
    const int64_t n = std::min<int64_t>(total, kBlock - 1);
    data.assign(head.data_ptr<int64_t>() + 1, head.data_ptr<int64_t>() + 1 + n);
  }
  if (total > kBlock - 1) {
    at::Tensor rest = group->rank() == 0 ? at::tensor(std::vector<int64_t>(data.begin() + (kBlock - 1), data.end()), at::kLong)
                                         : at::zeros({total - (kBlock - 1)}, at::kLong);
    group->broadcast(rest, /*src=*/0);
    if (group->rank() != 0) data.insert(data.end(), rest.data_ptr<int64_t>(), rest.data_ptr<int64_t>() + rest.numel());
  }
  return group->rank() == 0 ? plan : decode_plan(data);
}

Engine::Engine(models::Llama& model, int64_t max_batch, int64_t max_prefill, int64_t context)
    : model_(model),
      max_batch_(max_batch),
      max_prefill_(max_prefill),
      context_(context),
      main_(max_batch, context),
      prefill_(max_prefill, context) {
  TORCH_CHECK(context <= model->config.max_seq_len, "dtp-serve: --context: got ", context,
              ", expected at most the model's max_seq_len ", model->config.max_seq_len, ". Lower --context.");
  // The layout cached_attention caches keys in: this rank's KV heads.
  auto* block = model->layers->ptr(0)->as<dtp::nn::HookedImpl<models::TransformerBlockImpl>>();
  TORCH_CHECK(block != nullptr, "dtp-serve: the model has no transformer blocks: got 0 layers, expected at least 1.");
  const auto& attention = block->attention;
  const at::Tensor wk = attention->wk->weight;
  const int64_t rows = is_dtensor(wk) ? to_local(wk).size(0) : wk.size(0);
  const int64_t kv_heads = attention->kv_head >= 0 ? 1 : rows / attention->head_dim;
  like_ = at::zeros({1, 1, kv_heads, attention->head_dim},
                    at::TensorOptions().dtype(model->config.dtype).device(model->config.device));
}

std::vector<int64_t> Engine::sampleRows(const at::Tensor& logits, std::vector<Row>& rows) {
  const int64_t n = static_cast<int64_t>(rows.size());
  std::vector<int64_t> out(n, -1), greedy;
  for (int64_t r = 0; r < n; ++r) {
    if (rows[r].options.temperature == 0.0) greedy.push_back(r);
  }
  if (!greedy.empty()) {
    // Greedy draws nothing from a generator: one call for all of them.
    const at::Tensor part = static_cast<int64_t>(greedy.size()) == n ? logits : selectRows(logits, greedy);
    const std::vector<int64_t> picked = inference::sample(part, inference::SamplingOptions{}, rows[greedy[0]].gen);
    for (size_t i = 0; i < greedy.size(); ++i) out[greedy[i]] = picked[i];
  }
  for (int64_t r = 0; r < n; ++r) {
    if (rows[r].options.temperature == 0.0) continue;
    const at::Tensor part = n == 1 ? logits : selectRows(logits, {r});
    out[r] = inference::sample(part, rows[r].options, rows[r].gen)[0];
  }
  return out;
}

void Engine::joinPrefilled(const std::vector<int64_t>& lengths) {
  const int64_t n = static_cast<int64_t>(rows_.size()), k = static_cast<int64_t>(lengths.size());
  std::vector<int64_t> all = n > 0 ? main_.lengths() : std::vector<int64_t>();
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(all.size()) == n);
  all.insert(all.end(), lengths.begin(), lengths.end());
  main_.reset(n + k);
  for (int64_t l = 0; l < model_->config.n_layers; ++l) {
    auto [mk, mv] = main_.layer(l, like_);
    auto [pk, pv] = prefill_.layer(l, like_);
    for (int64_t j = 0; j < k; ++j) {
      mk[n + j].narrow(0, 0, lengths[j]).copy_(pk[j].narrow(0, 0, lengths[j]));
      mv[n + j].narrow(0, 0, lengths[j]).copy_(pv[j].narrow(0, 0, lengths[j]));
    }
  }
  // The cache's lengths: a zero-token call that advances each row by its
  // cached tokens (begin/end only count; nothing is computed).
  main_.begin(all, *std::max_element(all.begin(), all.end()));
  main_.end(all);
}

StepResult Engine::run(const StepPlan& plan) {
  torch::NoGradGuard no_grad;
  StepResult result;
  const auto device = model_->config.device;
  // 1. Finished rows leave.
  bool same = plan.keep.size() == rows_.size();
  for (size_t i = 0; same && i < plan.keep.size(); ++i) same = plan.keep[i] == static_cast<int64_t>(i);
  if (!same) {
    std::vector<Row> kept;
    for (int64_t r : plan.keep) {
      TORCH_CHECK(r >= 0 && r < static_cast<int64_t>(rows_.size()), "dtp-serve: a plan keeps row ", r,
                  " of a batch of ", rows_.size(), ": got an out-of-range row, expected one that runs.");
      kept.push_back(rows_[r]);
    }
    if (!plan.keep.empty()) main_.keep(plan.keep);
    rows_ = std::move(kept);
  }
  // 2. Decode one token for each running row.
  if (!rows_.empty()) {
    const int64_t n = static_cast<int64_t>(rows_.size());
    const at::Tensor tokens = at::tensor(plan.tokens, at::kLong).view({n, 1}).to(device);
    const at::Tensor logits = model_->forward(tokens, main_, std::vector<int64_t>(n, 1));
    result.decoded = sampleRows(logits, rows_);
  }
  // 3. Prefill the admitted prompts and let them join.
  if (!plan.admit.empty()) {
    const int64_t k = static_cast<int64_t>(plan.admit.size());
    TORCH_CHECK(k <= max_prefill_ && running() + k <= max_batch_, "dtp-serve: a plan admits ", k, " prompts to ",
                running(), " running: got more than the cache holds, expected at most ", max_prefill_,
                " per step and ", max_batch_, " in all.");
    std::vector<int64_t> lengths;
    int64_t longest = 0;
    for (const Admission& a : plan.admit) {
      lengths.push_back(static_cast<int64_t>(a.prompt.size()));
      longest = std::max(longest, lengths.back());
    }
    at::Tensor tokens = at::zeros({k, longest}, at::kLong);
    for (int64_t j = 0; j < k; ++j) tokens[j].narrow(0, 0, lengths[j]).copy_(at::tensor(plan.admit[j].prompt, at::kLong));
    prefill_.reset(k);
    const at::Tensor logits = model_->forward(tokens.to(device), prefill_, lengths);
    std::vector<Row> joined;
    for (const Admission& a : plan.admit) {
      joined.push_back(Row{a.id, a.sampling.options, at::make_generator<at::CPUGeneratorImpl>(a.sampling.seed)});
    }
    result.first = sampleRows(logits, joined);
    joinPrefilled(lengths);
    rows_.insert(rows_.end(), joined.begin(), joined.end());
  }
  return result;
}

}  // namespace dtp::serve
