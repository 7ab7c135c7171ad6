#include "model_runner.h"

#include "dtp/dtensor.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cstring>

namespace dtp::inference {
namespace {

// Rows `idx` of logits [B, 1, V], plain or sharded on V, keeping the layout.
at::Tensor selectRows(const at::Tensor& logits, const std::vector<int64_t>& idx) {
  const at::Tensor index = at::tensor(idx, at::kLong);
  if (!is_dtensor(logits)) return logits.index_select(0, index.to(logits.device()));
  const at::Tensor local = to_local(logits);
  const at::Tensor rows = local.index_select(0, index.to(local.device()));
  return from_local(rows, device_mesh(logits), placements(logits), /*run_check=*/false,
                    std::vector<int64_t>{static_cast<int64_t>(idx.size()), logits.size(1), logits.size(2)});
}


// K and V of one block over all layers (by the largest share of KV heads:
// with KV heads sharded unevenly every rank holds as many blocks).
int64_t blockBytes(const KvShape& kv, int64_t block_size) {
  return 2 * kv.layers * block_size * kv.largest_share * kv.head_dim * static_cast<int64_t>(c10::elementSize(kv.dtype));
}

// The pool's blocks: kv_cache_mib per rank, or kv_cache_blocks, or
// max_batch sequences of `context`. Spread over `shards` ranks (NOTE: [KV
// cache sharded over cp]), a rank's budget holds 1/shards of the pool.
int64_t numBlocks(const KvShape& kv, const EngineOptions& o, int64_t shards) {
  TORCH_CHECK(o.block_size > 0 && o.context > 0 && o.max_batch > 0 && o.prefill_chunk > 0 && o.max_prefill > 0,
              "dtp::inference::Engine: EngineOptions block_size, context, max_batch, prefill_chunk and max_prefill must be "
              "positive: got ", o.block_size, ", ", o.context, ", ", o.max_batch, ", ", o.prefill_chunk, ", ", o.max_prefill, ".");
  const int64_t per_seq = (o.context + o.block_size - 1) / o.block_size, bytes = blockBytes(kv, o.block_size);
  if (o.kv_cache_mib <= 0 && o.kv_cache_blocks <= 0) return o.max_batch * per_seq;
  const int64_t n = o.kv_cache_blocks > 0 ? o.kv_cache_blocks : o.kv_cache_mib * (int64_t{1} << 20) / bytes * shards;
  // A sequence alone always fits, so preempting the others lets the oldest go on.
  const int64_t mib = ((per_seq + shards - 1) / shards * bytes + (1 << 20) - 1) >> 20;
  TORCH_CHECK(n >= per_seq, "dtp::inference::Engine: kv_cache_mib ", o.kv_cache_mib, " / kv_cache_blocks ", o.kv_cache_blocks,
              " holds ", n, " KV blocks of ", o.block_size, " tokens (", bytes, " bytes each on this rank",
              shards > 1 ? c10::str(", the pool spread over ", shards, " ranks") : std::string(), "), but one sequence of "
              "context ", o.context, " needs ", per_seq, ". Raise kv_cache_mib (dtp-serve: --kv-cache-mib) to at least ",
              mib, ", or lower context.");
  return n;
}

}  // namespace

ModelRunner::ModelRunner(Model& model, const EngineOptions& options)
    : model_(model),
      o_(options),
      block_bytes_(blockBytes(model.kv_shape(), options.block_size)),
      pool_(numBlocks(model.kv_shape(), options, model.kv_cache_group().valid() ? model.kv_cache_group().size() : 1),
            options.block_size, options.prefix_caching),
      cache_(KVCache::paged(pool_.total(), options.block_size)) {
  if (const ProcessGroup group = model.kv_cache_group(); group.valid()) cache_.shard_blocks(group);
  // The pool, allocated now: a cache too large for memory fails at start.
  const KvShape kv = model.kv_shape();
  device_ = kv.device;
  const at::Tensor like = at::zeros({1, 1, kv.local_heads, kv.head_dim}, at::TensorOptions().dtype(kv.dtype).device(kv.device));
  for (int64_t l = 0; l < kv.layers; ++l) cache_.layer(l, like);
}

void ModelRunner::sampleRows(const at::Tensor& logits, const std::vector<Row*>& rows, const std::vector<int64_t>& slots,
                             StepResult& result) {
  const int64_t n = static_cast<int64_t>(rows.size());
  std::vector<int64_t> out(n, -1), greedy;
  for (int64_t r = 0; r < n; ++r) {
    if (rows[r]->options.temperature == 0.0) greedy.push_back(r);
  }
  if (!greedy.empty()) {
    // Greedy draws nothing from a generator: one call for all of them.
    const at::Tensor part = static_cast<int64_t>(greedy.size()) == n ? logits : selectRows(logits, greedy);
    const std::vector<int64_t> picked = sample(part, SamplingOptions{}, rows[greedy[0]]->gen);
    for (size_t i = 0; i < greedy.size(); ++i) out[greedy[i]] = picked[i];
  }
  for (int64_t r = 0; r < n; ++r) {
    if (rows[r]->options.temperature == 0.0) continue;
    const at::Tensor part = n == 1 ? logits : selectRows(logits, {r});
    out[r] = sample(part, rows[r]->options, rows[r]->gen)[0];
  }
  // Logprobs of the drawn tokens (NOTE: [Logprobs in one all-gather] in
  // sampling.cpp): one call for every row that asks, with the largest k.
  std::vector<int64_t> asking, drawn;
  int64_t k = 0;
  for (int64_t r = 0; r < n; ++r) {
    if (rows[r]->logprobs < 0) continue;
    asking.push_back(r);
    drawn.push_back(out[r]);
    k = std::max(k, rows[r]->logprobs);
  }
  if (!asking.empty()) {
    const at::Tensor part = static_cast<int64_t>(asking.size()) == n ? logits : selectRows(logits, asking);
    std::vector<TokenLogprobs> lp = logprobs(part, drawn, k);
    for (size_t i = 0; i < asking.size(); ++i) {
      lp[i].top.resize(std::min<size_t>(lp[i].top.size(), rows[asking[i]]->logprobs));
      result.logprobs[slots[asking[i]]] = std::move(lp[i]);
    }
  }
  for (int64_t r = 0; r < n; ++r) result.tokens[slots[r]] = out[r];
}

void ModelRunner::admit(const Admission& a) {
  TORCH_CHECK(!a.prompt.empty() && static_cast<int64_t>(a.prompt.size()) < o_.context, "dtp::inference: a plan admits ",
              a.prompt.size(), " tokens for request ", a.id, ": got a prompt outside [1, context), expected one "
              "inside. Ranks must run the same dtp build.");
  Row row{a.id, a.sampling.options, a.logprobs, at::Generator(), a.prompt, 0, {}};
  if (a.resume) {
    auto it = preempted_.find(a.id);
    TORCH_CHECK(it != preempted_.end(), "dtp::inference: a plan resumes request ", a.id, ", which was not preempted. Ranks "
                "must run the same dtp build.");
    row.gen = it->second;
    preempted_.erase(it);
  } else {
    row.gen = at::make_generator<at::CPUGeneratorImpl>(a.sampling.seed);
  }
  // The prompt's cached prefix (held in run() before any block is taken,
  // so that no take() evicts it), then fresh blocks for the rest.
  row.blocks = pool_.hold_prefix(a.prompt);
  row.cached = static_cast<int64_t>(row.blocks.size()) * o_.block_size;
  TORCH_CHECK(row.cached == a.cached, "dtp::inference: a plan admits request ", a.id, " with ", a.cached, " prompt "
              "tokens in the prefix cache, but this rank's cache holds ", row.cached, ": got ranks whose caches "
              "differ, expected the same. Ranks must run the same dtp build and EngineOptions.");
  rows_.push_back(std::move(row));
}

StepResult ModelRunner::run(const StepPlan& plan) {
  at::NoGradGuard no_grad;
  // 1. Rows leave (finished, cancelled, preempted); their blocks return.
  const int64_t before = static_cast<int64_t>(rows_.size());
  std::vector<char> kept(before, 0), preempted(before, 0);
  for (const auto* list : {&plan.keep, &plan.preempt}) {
    for (size_t i = 0; i < list->size(); ++i) {
      const int64_t r = (*list)[i];
      TORCH_CHECK(r >= 0 && r < before && (i == 0 || r > (*list)[i - 1]) && !kept[r], "dtp::inference: a plan names row ",
                  r, " of a batch of ", before, ": got an out-of-range, repeated or unordered row, expected "
                  "ascending rows that run. Ranks must run the same dtp build.");
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
  // 2. Admitted requests join: first each holds its cached prefix, then
  // each takes fresh blocks for the rest of its prompt.
  const size_t first_admitted = rows_.size();
  for (const Admission& a : plan.admit) admit(a);
  for (size_t i = first_admitted; i < rows_.size(); ++i) {
    Row& row = rows_[i];
    for (int64_t b = blocks_for(static_cast<int64_t>(row.prompt.size())) - static_cast<int64_t>(row.blocks.size()); b > 0; --b)
      row.blocks.push_back(pool_.take());
  }
  TORCH_CHECK(static_cast<int64_t>(rows_.size()) <= o_.max_batch, "dtp::inference: a plan runs ", rows_.size(),
              " sequences, expected at most max_batch ", o_.max_batch, ". Ranks must run the same dtp build.");
  StepResult result;
  result.tokens.assign(rows_.size(), -1);
  result.logprobs.assign(rows_.size(), std::nullopt);
  std::vector<int64_t> decoding, prefilling;
  for (size_t i = 0; i < rows_.size(); ++i) (rows_[i].decoding() ? decoding : prefilling).push_back(static_cast<int64_t>(i));
  TORCH_CHECK(plan.tokens.size() == decoding.size() && plan.chunks.size() == prefilling.size(), "dtp::inference: a plan "
              "gives ", plan.tokens.size(), " input tokens and ", plan.chunks.size(), " prefill chunks, expected ",
              decoding.size(), " and ", prefilling.size(), ". Ranks must run the same dtp build.");
  // 3. Which rows run: each decoding row with its input token (a row whose
  // blocks are full takes one more), each prefilling row with its chunk.
  std::vector<int64_t> chunk(rows_.size(), 0);
  for (size_t j = 0; j < decoding.size(); ++j) chunk[decoding[j]] = 1;
  int64_t total = 0, prefill_rows = 0;
  for (size_t j = 0; j < prefilling.size(); ++j) {
    const Row& row = rows_[prefilling[j]];
    const int64_t c = plan.chunks[j];
    TORCH_CHECK(c >= 0 && row.cached + c <= static_cast<int64_t>(row.prompt.size()), "dtp::inference: a plan prefills ",
                c, " tokens of request ", row.id, ", which has ", row.prompt.size() - row.cached, " left. Ranks must "
                "run the same dtp build.");
    chunk[prefilling[j]] = c;
    total += c;
    prefill_rows += c > 0;
  }
  TORCH_CHECK(total <= o_.prefill_chunk && prefill_rows <= o_.max_prefill, "dtp::inference: a "
              "plan prefills ", total, " tokens of ", prefill_rows, " sequences, expected at most prefill_chunk ",
              o_.prefill_chunk, " of max_prefill ", o_.max_prefill, ". Ranks must run the same dtp build.");
  // 4. One packed forward for all of them (NOTE: [Packed batch] in
  // kv_cache.h): decode tokens and prefill chunks side by side; or, with
  // EngineOptions::one_forward_per_step false, decode rows and prefill
  // rows as two forwards (the engine before, kept to measure against).
  std::vector<int64_t> decode_rows, prefill_rows_idx;
  for (size_t i = 0; i < rows_.size(); ++i) {
    if (chunk[i] > 0) (rows_[i].decoding() || o_.one_forward_per_step ? decode_rows : prefill_rows_idx).push_back(i);
  }
  for (const auto* part : {&decode_rows, &prefill_rows_idx}) {
    if (!part->empty()) forwardRows(*part, chunk, plan, result);
  }
  return result;
}

void ModelRunner::forwardRows(const std::vector<int64_t>& rows, const std::vector<int64_t>& chunk, const StepPlan& plan,
                              StepResult& result) {
  // The input token of a decoding row: plan.tokens holds one per decoding
  // row of the batch, in row order.
  std::vector<int64_t> token_of(rows_.size(), -1);
  size_t next_token = 0;
  for (size_t i = 0; i < rows_.size(); ++i) {
    if (rows_[i].decoding()) token_of[i] = plan.tokens[next_token++];
  }
  std::vector<int64_t> valid, flat, lengths;
  std::vector<std::vector<int64_t>> tables;
  for (int64_t i : rows) {
    Row& row = rows_[i];
    if (row.decoding()) {
      if (row.cached + 1 > static_cast<int64_t>(row.blocks.size()) * o_.block_size) row.blocks.push_back(pool_.take());
      flat.push_back(token_of[i]);
    } else {
      flat.insert(flat.end(), row.prompt.begin() + row.cached, row.prompt.begin() + row.cached + chunk[i]);
    }
    valid.push_back(chunk[i]);
    tables.push_back(row.blocks);
    lengths.push_back(row.cached);
  }
  cache_.set_batch(std::move(tables), std::move(lengths), /*packed=*/true);
  const int64_t n = static_cast<int64_t>(flat.size());
  const at::Tensor logits =
      model_.forward(at::tensor(flat, at::kLong).view({1, n}).to(device_), cache_, valid);
  // 5. Rows done with their prompt draw a token (one sampling pass).
  std::vector<int64_t> drawing, slots;
  std::vector<Row*> batch;
  for (size_t j = 0; j < rows.size(); ++j) {
    Row& row = rows_[rows[j]];
    const bool prefilled = !row.decoding();
    row.cached += valid[j];
    // The prompt's blocks that became full are cached for later requests.
    if (prefilled) pool_.commit(row.blocks, row.prompt, std::min<int64_t>(row.cached, static_cast<int64_t>(row.prompt.size())));
    if (!row.decoding()) continue;
    drawing.push_back(static_cast<int64_t>(j));
    slots.push_back(rows[j]);
    batch.push_back(&row);
  }
  if (!drawing.empty()) sampleRows(drawing.size() == rows.size() ? logits : selectRows(logits, drawing), batch, slots, result);
}

}  // namespace dtp::inference
