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
  std::vector<int64_t> d = {p.op};
  auto list = [&](const std::vector<int64_t>& v) {
    d.push_back(static_cast<int64_t>(v.size()));
    d.insert(d.end(), v.begin(), v.end());
  };
  list(p.keep);
  list(p.preempt);
  list(p.forget);
  list(p.tokens);
  list(p.chunks);
  d.push_back(static_cast<int64_t>(p.admit.size()));
  for (const Admission& a : p.admit) {
    d.insert(d.end(), {a.id, static_cast<int64_t>(a.sampling.seed), bitsOf(a.sampling.options.temperature),
                       a.sampling.options.top_k, bitsOf(a.sampling.options.top_p), a.resume ? 1 : 0});
    list(a.prompt);
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
  auto list = [&](std::vector<int64_t>& v) {
    const int64_t n = next();
    for (int64_t k = 0; k < n; ++k) v.push_back(next());
  };
  p.op = next();
  list(p.keep);
  list(p.preempt);
  list(p.forget);
  list(p.tokens);
  list(p.chunks);
  const int64_t admit = next();
  for (int64_t k = 0; k < admit; ++k) {
    Admission a;
    a.id = next();
    a.sampling.seed = static_cast<uint64_t>(next());
    a.sampling.options.temperature = doubleOf(next());
    a.sampling.options.top_k = next();
    a.sampling.options.top_p = doubleOf(next());
    a.resume = next() != 0;
    list(a.prompt);
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

namespace {

struct KvLayout {
  int64_t local_heads, head_dim, largest_share;  // largest_share: the most KV heads any rank holds
};

// The model's KV heads on this rank. With KV heads sharded unevenly
// (torch.chunk: 3 heads over 2 ranks -> 2, 1) every rank sizes its pool by
// the largest share, so that every rank holds as many blocks.
KvLayout kvLayout(models::Llama& model) {
  auto* block = model->layers->ptr(0)->as<dtp::nn::HookedImpl<models::TransformerBlockImpl>>();
  TORCH_CHECK(block != nullptr, "dtp-serve: the model has no transformer blocks: got 0 layers, expected at least 1.");
  const auto& attention = block->attention;
  const at::Tensor wk = attention->wk->weight;
  const int64_t head_dim = attention->head_dim;
  if (attention->kv_head >= 0) return {1, head_dim, 1};  // fewer KV heads than ranks: one each
  if (!is_dtensor(wk)) return {wk.size(0) / head_dim, head_dim, wk.size(0) / head_dim};
  const int64_t heads = wk.size(0) / head_dim, tp = device_mesh(wk).size();
  return {to_local(wk).size(0) / head_dim, head_dim, (heads + tp - 1) / tp};
}

// K and V of one block over all layers (by the largest share of KV heads).
int64_t blockBytes(models::Llama& model, int64_t block_size) {
  const KvLayout kv = kvLayout(model);
  return 2 * model->config.n_layers * block_size * kv.largest_share * kv.head_dim *
         static_cast<int64_t>(c10::elementSize(model->config.dtype));
}

int64_t numBlocks(models::Llama& model, const EngineOptions& o) {
  TORCH_CHECK(o.block_size > 0 && o.context > 0 && o.max_batch > 0 && o.prefill_chunk > 0 && o.max_prefill > 0,
              "dtp-serve: --block-size, --context, --max-batch, --prefill-chunk and --max-prefill must be positive.");
  const int64_t per_seq = (o.context + o.block_size - 1) / o.block_size, bytes = blockBytes(model, o.block_size);
  if (o.kv_cache_mib <= 0 && o.kv_cache_blocks <= 0) return o.max_batch * per_seq;
  const int64_t n = o.kv_cache_blocks > 0 ? o.kv_cache_blocks : o.kv_cache_mib * (int64_t{1} << 20) / bytes;
  // A sequence alone always fits, so preempting the others lets the oldest go on.
  TORCH_CHECK(n >= per_seq, "dtp-serve: --kv-cache-mib ", o.kv_cache_mib, " / --kv-cache-blocks ", o.kv_cache_blocks,
              " holds ", n, " KV blocks of ", o.block_size,
              " tokens (", bytes, " bytes each on this rank), but one sequence of --context ", o.context, " needs ",
              per_seq, ". Raise --kv-cache-mib to at least ", (per_seq * bytes + (1 << 20) - 1) >> 20,
              ", or lower --context.");
  return n;
}

}  // namespace

Engine::Engine(models::Llama& model, const EngineOptions& options)
    : model_(model),
      o_(options),
      block_bytes_(blockBytes(model, options.block_size)),
      pool_(numBlocks(model, options)),
      cache_(models::KVCache::paged(pool_.total(), options.block_size)) {
  TORCH_CHECK(o_.context <= model->config.max_seq_len, "dtp-serve: --context: got ", o_.context,
              ", expected at most the model's max_seq_len ", model->config.max_seq_len, ". Lower --context.");
  // The pool, allocated now: a cache too large for memory fails at start.
  const KvLayout kv = kvLayout(model);
  const at::Tensor like = at::zeros({1, 1, kv.local_heads, kv.head_dim},
                                    at::TensorOptions().dtype(model->config.dtype).device(model->config.device));
  for (int64_t l = 0; l < model->config.n_layers; ++l) cache_.layer(l, like);
}

std::vector<int64_t> Engine::sampleRows(const at::Tensor& logits, const std::vector<Row*>& rows) {
  const int64_t n = static_cast<int64_t>(rows.size());
  std::vector<int64_t> out(n, -1), greedy;
  for (int64_t r = 0; r < n; ++r) {
    if (rows[r]->options.temperature == 0.0) greedy.push_back(r);
  }
  if (!greedy.empty()) {
    // Greedy draws nothing from a generator: one call for all of them.
    const at::Tensor part = static_cast<int64_t>(greedy.size()) == n ? logits : selectRows(logits, greedy);
    const std::vector<int64_t> picked = inference::sample(part, inference::SamplingOptions{}, rows[greedy[0]]->gen);
    for (size_t i = 0; i < greedy.size(); ++i) out[greedy[i]] = picked[i];
  }
  for (int64_t r = 0; r < n; ++r) {
    if (rows[r]->options.temperature == 0.0) continue;
    const at::Tensor part = n == 1 ? logits : selectRows(logits, {r});
    out[r] = inference::sample(part, rows[r]->options, rows[r]->gen)[0];
  }
  return out;
}

void Engine::admit(const Admission& a) {
  TORCH_CHECK(!a.prompt.empty() && static_cast<int64_t>(a.prompt.size()) < o_.context, "dtp-serve: a plan admits ",
              a.prompt.size(), " tokens for request ", a.id, ": got a prompt outside [1, --context), expected one "
              "inside. Ranks must run the same dtp-serve build.");
  Row row{a.id, a.sampling.options, at::Generator(), a.prompt, 0, {}};
  if (a.resume) {
    auto it = preempted_.find(a.id);
    TORCH_CHECK(it != preempted_.end(), "dtp-serve: a plan resumes request ", a.id, ", which was not preempted. Ranks "
                "must run the same dtp-serve build.");
    row.gen = it->second;
    preempted_.erase(it);
  } else {
    row.gen = at::make_generator<at::CPUGeneratorImpl>(a.sampling.seed);
  }
  for (int64_t b = blocks_for(static_cast<int64_t>(a.prompt.size())); b > 0; --b) row.blocks.push_back(pool_.take());
  rows_.push_back(std::move(row));
}

StepResult Engine::run(const StepPlan& plan) {
  torch::NoGradGuard no_grad;
  const auto device = model_->config.device;
  // 1. Rows leave (finished, cancelled, preempted); their blocks return.
  const int64_t before = static_cast<int64_t>(rows_.size());
  std::vector<char> kept(before, 0), preempted(before, 0);
  for (const auto* list : {&plan.keep, &plan.preempt}) {
    for (size_t i = 0; i < list->size(); ++i) {
      const int64_t r = (*list)[i];
      TORCH_CHECK(r >= 0 && r < before && (i == 0 || r > (*list)[i - 1]) && !kept[r], "dtp-serve: a plan names row ",
                  r, " of a batch of ", before, ": got an out-of-range, repeated or unordered row, expected "
                  "ascending rows that run. Ranks must run the same dtp-serve build.");
      (list == &plan.keep ? kept : preempted)[r] = 1;
    }
  }
  std::vector<Row> rows;
  for (int64_t r = 0; r < before; ++r) {
    if (kept[r]) {
      rows.push_back(std::move(rows_[r]));
      continue;
    }
    pool_.give_back(rows_[r].blocks);
    if (preempted[r]) preempted_[rows_[r].id] = rows_[r].gen;
  }
  rows_ = std::move(rows);
  for (int64_t id : plan.forget) preempted_.erase(id);
  // 2. Admitted requests join with the blocks of their prompts.
  for (const Admission& a : plan.admit) admit(a);
  TORCH_CHECK(static_cast<int64_t>(rows_.size()) <= o_.max_batch, "dtp-serve: a plan runs ", rows_.size(),
              " sequences, expected at most --max-batch ", o_.max_batch, ". Ranks must run the same dtp-serve build.");
  StepResult result;
  result.tokens.assign(rows_.size(), -1);
  std::vector<int64_t> decoding, prefilling;
  for (size_t i = 0; i < rows_.size(); ++i) (rows_[i].decoding() ? decoding : prefilling).push_back(static_cast<int64_t>(i));
  TORCH_CHECK(plan.tokens.size() == decoding.size() && plan.chunks.size() == prefilling.size(), "dtp-serve: a plan "
              "gives ", plan.tokens.size(), " input tokens and ", plan.chunks.size(), " prefill chunks, expected ",
              decoding.size(), " and ", prefilling.size(), ". Ranks must run the same dtp-serve build.");
  // 3. Decode one token for each row done with its prompt.
  if (!decoding.empty()) {
    const int64_t n = static_cast<int64_t>(decoding.size());
    std::vector<std::vector<int64_t>> tables;
    std::vector<int64_t> lengths;
    std::vector<Row*> batch;
    for (int64_t i : decoding) {
      Row& row = rows_[i];
      if (row.cached + 1 > static_cast<int64_t>(row.blocks.size()) * o_.block_size) row.blocks.push_back(pool_.take());
      tables.push_back(row.blocks);
      lengths.push_back(row.cached);
      batch.push_back(&row);
    }
    cache_.set_batch(std::move(tables), std::move(lengths));
    const at::Tensor tokens = at::tensor(plan.tokens, at::kLong).view({n, 1}).to(device);
    const at::Tensor logits = model_->forward(tokens, cache_, std::vector<int64_t>(n, 1));
    const std::vector<int64_t> drawn = sampleRows(logits, batch);
    for (int64_t j = 0; j < n; ++j) {
      ++rows_[decoding[j]].cached;
      result.tokens[decoding[j]] = drawn[j];
    }
  }
  // 4. Prefill the next chunk of each row still prefilling.
  std::vector<int64_t> chunked, valid;
  int64_t total = 0;
  for (size_t j = 0; j < prefilling.size(); ++j) {
    const Row& row = rows_[prefilling[j]];
    const int64_t c = plan.chunks[j];
    TORCH_CHECK(c >= 0 && row.cached + c <= static_cast<int64_t>(row.prompt.size()), "dtp-serve: a plan prefills ",
                c, " tokens of request ", row.id, ", which has ", row.prompt.size() - row.cached, " left. Ranks must "
                "run the same dtp-serve build.");
    if (c == 0) continue;
    chunked.push_back(prefilling[j]);
    valid.push_back(c);
    total += c;
  }
  TORCH_CHECK(total <= o_.prefill_chunk && static_cast<int64_t>(chunked.size()) <= o_.max_prefill, "dtp-serve: a "
              "plan prefills ", total, " tokens of ", chunked.size(), " sequences, expected at most --prefill-chunk ",
              o_.prefill_chunk, " of --max-prefill ", o_.max_prefill, ". Ranks must run the same dtp-serve build.");
  if (!chunked.empty()) {
    const int64_t k = static_cast<int64_t>(chunked.size()), width = *std::max_element(valid.begin(), valid.end());
    at::Tensor tokens = at::zeros({k, width}, at::kLong);
    std::vector<std::vector<int64_t>> tables;
    std::vector<int64_t> lengths;
    for (int64_t j = 0; j < k; ++j) {
      const Row& row = rows_[chunked[j]];
      const std::vector<int64_t> piece(row.prompt.begin() + row.cached, row.prompt.begin() + row.cached + valid[j]);
      tokens[j].narrow(0, 0, valid[j]).copy_(at::tensor(piece, at::kLong));
      tables.push_back(row.blocks);
      lengths.push_back(row.cached);
    }
    cache_.set_batch(std::move(tables), std::move(lengths));
    const at::Tensor logits = model_->forward(tokens.to(device), cache_, valid);
    std::vector<int64_t> done;
    std::vector<Row*> finished;
    for (int64_t j = 0; j < k; ++j) {
      Row& row = rows_[chunked[j]];
      row.cached += valid[j];
      if (row.decoding()) {
        done.push_back(j);
        finished.push_back(&row);
      }
    }
    if (!done.empty()) {
      const std::vector<int64_t> drawn =
          sampleRows(static_cast<int64_t>(done.size()) == k ? logits : selectRows(logits, done), finished);
      for (size_t j = 0; j < done.size(); ++j) result.tokens[chunked[done[j]]] = drawn[j];
    }
  }
  return result;
}

}  // namespace dtp::serve
