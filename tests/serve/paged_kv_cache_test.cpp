// The paged KV cache (NOTE: [Paged KV cache] in kv_cache.h) against the
// contiguous one, in float64 on the reference Llama with grouped KV heads:
// the same prefill and greedy decode give the same logits, whether the
// prompts are prefilled at once or in chunks of a few tokens (sequences in
// and out of the batch between calls, as dtp-serve runs them), with blocks
// scattered over the pool; at TP 2 too; padding beside a longer chunk stays
// within the model's positions. Bad tables are named errors.
#include "close.h"
#include "dist.h"
#include "llama_util.h"

#include "dtp/dtensor.h"
#include "dtp/models/generate.h"
#include "dtp/models/llama.h"

#include <algorithm>
#include <cstdio>
#include <mutex>

using namespace dtp;
using namespace dtp::models;
using dtp::test::run_ranks;

namespace {

LlamaConfig config() {
  LlamaConfig c = dtp::test::small_llama_config(2);  // 4 heads over 2 KV heads: grouped
  c.max_seq_len = 32;
  c.seed = 3;
  c.dtype = at::kDouble;
  return c;
}

const std::vector<std::vector<int64_t>> kPrompts = {{5, 9, 2}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {60, 61, 62, 63, 64}};
constexpr int kDecodeSteps = 6;

at::Tensor plain(const at::Tensor& t) { return is_dtensor(t) ? full_tensor(t) : t; }

// Each sequence's logits [vocab] after its prompt, then after each of
// kDecodeSteps greedy tokens; one prefill of all prompts, right-padded.
std::vector<std::vector<at::Tensor>> contiguous(Llama& model) {
  at::NoGradGuard no_grad;
  const int64_t n = static_cast<int64_t>(kPrompts.size());
  KVCache cache(n, 32);
  cache.reset(n);
  std::vector<int64_t> valid;
  int64_t longest = 0;
  for (const auto& p : kPrompts) {
    valid.push_back(static_cast<int64_t>(p.size()));
    longest = std::max(longest, valid.back());
  }
  at::Tensor tokens = at::zeros({n, longest}, at::kLong);
  for (int64_t b = 0; b < n; ++b) tokens[b].narrow(0, 0, valid[b]).copy_(at::tensor(kPrompts[b], at::kLong));
  std::vector<std::vector<at::Tensor>> out(n);
  at::Tensor logits = plain(model->forward(tokens, cache, valid));
  for (int step = 0; step <= kDecodeSteps; ++step) {
    std::vector<int64_t> next;
    for (int64_t b = 0; b < n; ++b) {
      out[b].push_back(logits[b][0].clone());
      next.push_back(logits[b][0].argmax().item<int64_t>());
    }
    if (step < kDecodeSteps) logits = plain(model->forward(at::tensor(next, at::kLong).view({n, 1}), cache, std::vector<int64_t>(n, 1)));
  }
  return out;
}

// The same on a paged cache of 4-token blocks handed out from the end of
// the pool, alternating between sequences (no sequence's blocks are
// adjacent); prompts prefilled `chunk` tokens per call, only the sequences
// still prefilling in each call.
std::vector<std::vector<at::Tensor>> paged(Llama& model, int64_t chunk) {
  at::NoGradGuard no_grad;
  const int64_t n = static_cast<int64_t>(kPrompts.size()), bs = 4, num_blocks = 24;
  KVCache cache = KVCache::paged(num_blocks, bs);
  std::vector<std::vector<int64_t>> tables(n);
  std::vector<int64_t> lengths(n, 0);
  int64_t next_block = num_blocks - 1;
  auto reserve = [&](int64_t b, int64_t tokens) {  // room for `tokens` in sequence b
    while (static_cast<int64_t>(tables[b].size()) * bs < tokens) tables[b].push_back(next_block--);
  };
  std::vector<std::vector<at::Tensor>> out(n);
  std::vector<int64_t> last(n, -1);
  while (true) {  // chunked prefill
    std::vector<int64_t> rows, valid;
    for (int64_t b = 0; b < n; ++b) {
      const int64_t left = static_cast<int64_t>(kPrompts[b].size()) - lengths[b];
      if (left == 0) continue;
      rows.push_back(b);
      valid.push_back(std::min(chunk, left));
    }
    if (rows.empty()) break;
    const int64_t k = static_cast<int64_t>(rows.size()), width = *std::max_element(valid.begin(), valid.end());
    at::Tensor tokens = at::zeros({k, width}, at::kLong);
    std::vector<std::vector<int64_t>> t;
    std::vector<int64_t> l;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t b = rows[i];
      reserve(b, lengths[b] + valid[i]);
      const std::vector<int64_t> piece(kPrompts[b].begin() + lengths[b], kPrompts[b].begin() + lengths[b] + valid[i]);
      tokens[i].narrow(0, 0, valid[i]).copy_(at::tensor(piece, at::kLong));
      t.push_back(tables[b]);
      l.push_back(lengths[b]);
    }
    cache.set_batch(t, l);
    const at::Tensor logits = plain(model->forward(tokens, cache, valid));
    for (int64_t i = 0; i < k; ++i) {
      const int64_t b = rows[i];
      lengths[b] += valid[i];
      EXPECT_EQ(cache.lengths()[i], lengths[b]);
      if (lengths[b] == static_cast<int64_t>(kPrompts[b].size())) {
        out[b].push_back(logits[i][0].clone());
        last[b] = logits[i][0].argmax().item<int64_t>();
      }
    }
  }
  for (int step = 0; step < kDecodeSteps; ++step) {
    for (int64_t b = 0; b < n; ++b) reserve(b, lengths[b] + 1);
    cache.set_batch(tables, lengths);
    const at::Tensor logits = plain(model->forward(at::tensor(last, at::kLong).view({n, 1}), cache, std::vector<int64_t>(n, 1)));
    for (int64_t b = 0; b < n; ++b) {
      ++lengths[b];
      out[b].push_back(logits[b][0].clone());
      last[b] = logits[b][0].argmax().item<int64_t>();
    }
  }
  return out;
}

// The same through packed calls (NOTE: [Packed batch] in kv_cache.h), as
// the engine runs a step: every call holds every sequence not yet done, the
// ones done with their prompt decoding one greedy token beside the others'
// next `chunk` prompt tokens, [1, T] with no padding.
std::vector<std::vector<at::Tensor>> packed(Llama& model, int64_t chunk) {
  at::NoGradGuard no_grad;
  const int64_t n = static_cast<int64_t>(kPrompts.size()), bs = 4, num_blocks = 24;
  KVCache cache = KVCache::paged(num_blocks, bs);
  std::vector<std::vector<int64_t>> tables(n);
  std::vector<int64_t> lengths(n, 0), last(n, -1);
  int64_t next_block = num_blocks - 1;
  std::vector<std::vector<at::Tensor>> out(n);
  int64_t mixed = 0;  // calls that held decode and prefill rows together
  while (true) {
    std::vector<int64_t> rows, valid, flat;
    std::vector<std::vector<int64_t>> t;
    std::vector<int64_t> l;
    bool decodes = false, prefills = false;
    for (int64_t b = 0; b < n; ++b) {
      if (static_cast<int64_t>(out[b].size()) == kDecodeSteps + 1) continue;  // done
      const int64_t left = static_cast<int64_t>(kPrompts[b].size()) - lengths[b];
      const int64_t v = left > 0 ? std::min(chunk, left) : 1;
      if (left > 0) {
        flat.insert(flat.end(), kPrompts[b].begin() + lengths[b], kPrompts[b].begin() + lengths[b] + v);
        prefills = true;
      } else {
        flat.push_back(last[b]);
        decodes = true;
      }
      while (static_cast<int64_t>(tables[b].size()) * bs < lengths[b] + v) tables[b].push_back(next_block--);
      rows.push_back(b);
      valid.push_back(v);
      t.push_back(tables[b]);
      l.push_back(lengths[b]);
    }
    if (rows.empty()) break;
    mixed += decodes && prefills;
    cache.set_batch(t, l, /*packed=*/true);
    const int64_t total = static_cast<int64_t>(flat.size());
    const at::Tensor logits = plain(model->forward(at::tensor(flat, at::kLong).view({1, total}), cache, valid));
    EXPECT_EQ(logits.size(0), static_cast<int64_t>(rows.size()));
    for (size_t i = 0; i < rows.size(); ++i) {
      const int64_t b = rows[i];
      lengths[b] += valid[i];
      if (lengths[b] < static_cast<int64_t>(kPrompts[b].size())) continue;
      out[b].push_back(logits[i][0].clone());
      last[b] = logits[i][0].argmax().item<int64_t>();
    }
  }
  // With chunks shorter than the longest prompt, some calls mix both.
  if (chunk < 11) EXPECT_GT(mixed, 0) << "no call packed decode rows beside prefill chunks";
  return out;
}

double maxDiff(const std::vector<std::vector<at::Tensor>>& a, const std::vector<std::vector<at::Tensor>>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t s = 0; s < a.size(); ++s) {
    EXPECT_EQ(a[s].size(), b[s].size()) << "sequence " << s;
    for (size_t i = 0; i < std::min(a[s].size(), b[s].size()); ++i)
      worst = std::max(worst, (a[s][i] - b[s][i]).abs().max().item<double>());
  }
  return worst;
}

}  // namespace

TEST(PagedKVCacheTest, EqualsTheContiguousCacheInFloat64) {
  Llama model(config());
  model->eval();
  const auto want = contiguous(model);
  for (int64_t chunk : {int64_t{32}, int64_t{3}, int64_t{1}}) {
    const double diff = maxDiff(paged(model, chunk), want);
    EXPECT_LE(diff, 1e-12) << "paged (prefill chunks of " << chunk << ") vs contiguous";
    std::printf("paged vs contiguous KV cache, float64, prefill chunks of %lld, %d decode steps: max |diff| %.3g\n",
                static_cast<long long>(chunk), kDecodeSteps, diff);
  }
}

// Packed calls (decode rows beside prefill chunks, NOTE: [Packed batch]):
// the same logits as the contiguous cache, on one device and at TP 2.
TEST(PagedKVCacheTest, PackedCallsEqualTheContiguousCache) {
  Llama model(config());
  model->eval();
  const auto want = contiguous(model);
  for (int64_t chunk : {int64_t{32}, int64_t{3}, int64_t{1}}) {
    const double diff = maxDiff(packed(model, chunk), want);
    EXPECT_LE(diff, 1e-12) << "packed (prefill chunks of " << chunk << ") vs contiguous";
    std::printf("packed vs contiguous KV cache, float64, prefill chunks of %lld: max |diff| %.3g\n",
                static_cast<long long>(chunk), diff);
  }
  std::mutex mu;
  run_ranks(2, [&](int rank) {
    Llama tp(config());
    tp->eval();
    apply_tensor_parallel_for_inference(tp, init_device_mesh("cpu", {2}, {"tp"}));
    const double diff = maxDiff(packed(tp, 3), want);
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_LE(diff, 1e-12) << "rank " << rank << ": packed at TP 2 vs contiguous on one device";
  });
}

TEST(PagedKVCacheTest, EqualsTheContiguousCacheAtTp2) {
  const LlamaConfig c = config();
  Llama one(c);
  one->eval();
  const auto want = contiguous(one);
  std::mutex mu;
  run_ranks(2, [&](int rank) {
    Llama model(c);
    model->eval();
    apply_tensor_parallel_for_inference(model, init_device_mesh("cpu", {2}, {"tp"}));
    const double same_tp = maxDiff(paged(model, 3), contiguous(model)), vs_one = maxDiff(paged(model, 3), want);
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_LE(same_tp, 1e-12) << "rank " << rank << ": paged vs contiguous, both at TP 2";
    EXPECT_LE(vs_one, 1e-12) << "rank " << rank << ": paged at TP 2 vs contiguous on one device";
    if (rank == 0) std::printf("TP 2, float64: paged vs contiguous max |diff| %.3g, vs one device %.3g\n", same_tp, vs_one);
  });
}

// A chunk near the end of the model's positions beside a longer chunk: the
// padding stays within the positions (NOTE: [Paged padding]) and the short
// sequence's logits equal its call alone.
TEST(PagedKVCacheTest, PaddingNeverRunsPastTheModelsPositions) {
  Llama model(config());  // max_seq_len 32
  model->eval();
  at::NoGradGuard no_grad;
  KVCache cache = KVCache::paged(24, 4);
  std::vector<int64_t> a(28), b(10);
  for (int64_t i = 0; i < 28; ++i) a[i] = (i * 7) % 67;
  for (int64_t i = 0; i < 10; ++i) b[i] = (i * 5 + 1) % 67;
  const std::vector<int64_t> a_blocks = {0, 1, 2, 3, 4, 5, 6, 7}, b_blocks = {8, 9, 10};
  cache.set_batch({a_blocks}, {0});
  model->forward(at::tensor(a, at::kLong).view({1, 28}), cache, {28});  // sequence a: 28 cached
  const at::Tensor tail = at::tensor({11, 12, 13}, at::kLong);
  cache.set_batch({a_blocks}, {28});
  const at::Tensor alone = plain(model->forward(tail.view({1, 3}), cache, {3}))[0][0];  // positions 28..30
  at::Tensor both = at::zeros({2, 10}, at::kLong);
  both[0].narrow(0, 0, 3).copy_(tail);
  both[1].copy_(at::tensor(b, at::kLong));
  cache.set_batch({a_blocks, b_blocks}, {28, 0});  // a's padding would reach position 37 of 32
  const at::Tensor batched = plain(model->forward(both, cache, {3, 10}))[0][0];
  EXPECT_CLOSE(batched, alone, 0.0, 1e-12) << "a chunk beside a longer one vs alone";
}

TEST(PagedKVCacheTest, BadTablesAreNamedErrors) {
  Llama model(config());
  at::NoGradGuard no_grad;
  KVCache cache = KVCache::paged(4, 4);
  dtp::test::expect_error([&] { cache.reset(1); }, {"KVCache::reset: a paged cache takes its batch from set_batch"});
  dtp::test::expect_error([&] { cache.set_batch({{0, 9}}, {3}); }, {"sequence 0 holds block 9, expected blocks in [0, 4)"});
  dtp::test::expect_error([&] { cache.set_batch({{0}}, {5}); }, {"sequence 0 has 5 tokens in 1 blocks of 4"});
  cache.set_batch({{2}}, {3});
  dtp::test::expect_error([&] { model->forward(at::tensor({1, 2}, at::kLong).view({1, 2}), cache, {2}); },
                          {"would reach 5 tokens (3 cached + 2 in this call), but its 1 blocks hold 4"});
  KVCache contiguous(1, 8);
  dtp::test::expect_error([&] { contiguous.set_batch({{0}}, {0}); }, {"KVCache::set_batch: this cache is contiguous"});
}
