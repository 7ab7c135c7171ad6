// Generation under context parallelism (#58 item 2): a model with
// apply_context_parallel prefills a prompt over the cp group, gathers every
// layer's keys and values into each rank's KV cache, and decodes as without
// cp (NOTE: [Context-parallel prefill] in src/models/llama_cp_prefill.cpp).
// Checked in float64 against one device: the prefill's logits and those of
// the decode steps after it (which read the gathered cache) through the
// engine's model (engine_model) on a contiguous and on a paged, packed
// cache; greedy tokens of generate; at cp 2 and 4, ring and all-to-all,
// HeadTail and Contiguous, (cp, tp) = (2, 2), and Mistral's sliding window
// shorter than the prompts. The prefill's messages
// per rank equal the closed form (per layer ring's cp - 1 send/recv pairs or
// all-to-all's 4, and 1 all_gather; 1 all_reduce of the last tokens); a
// decode step sends none (cp alone).
//
// The bound, 1e-12 absolute: logits are O(1) (a random float64 model), the
// cp prefill reorders float64 sums (softmax merged over 2*cp blocks, the
// last hidden state summed with zeros: exact) by a few tens of unit
// roundoffs (u = 1.1e-16); decode reads keys and values computed by the same
// elementwise operations as one device's (projections on the rank's
// positions: the same dot products), so ~1e-14 again. A wrong position in
// the cache, a missing rotary offset or a layer's keys in another layer's
// slot moves the logits by 1e-2 or more.
#include "cp_step.h"
#include "dist.h"
#include "engine_util.h"
#include "llama_util.h"

#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/inference/engine.h"
#include "dtp/inference/kv_cache.h"
#include "dtp/models/engine_model.h"
#include "dtp/models/generate.h"
#include "dtp/models/parallelize.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

namespace {

using namespace dtp;
using namespace dtp::models;
using dtp::test::cp_all_to_all;
using dtp::test::cp_ring;
using dtp::test::run_ranks;

constexpr double kTol = 1e-12;  // see the bound above

LlamaConfig config() {
  LlamaConfig c = dtp::test::small_llama_config(2);  // 4 heads over 2 KV heads: GQA
  c.dtype = at::kDouble;
  c.max_seq_len = 48;
  c.seed = 5;
  return c;
}

// Prompts of 13, 9 and 16 tokens: the longest (16) sets the prefill's S.
const std::vector<std::vector<int64_t>> kPrompts = {
    {5, 9, 2, 33, 17, 8, 61, 40, 3, 12, 27, 50, 6},
    {1, 2, 3, 4, 5, 6, 7, 8, 9},
    {60, 61, 62, 63, 64, 10, 20, 30, 40, 50, 11, 21, 31, 41, 51, 66}};
constexpr int64_t kDecodeSteps = 3;

// Rows [B, S] right-padded (with 0) and their lengths.
std::pair<at::Tensor, std::vector<int64_t>> padded() {
  int64_t longest = 0;
  for (const auto& p : kPrompts) longest = std::max<int64_t>(longest, p.size());
  at::Tensor t = at::zeros({static_cast<int64_t>(kPrompts.size()), longest}, at::kLong);
  std::vector<int64_t> valid;
  for (size_t b = 0; b < kPrompts.size(); ++b) {
    t[b].narrow(0, 0, kPrompts[b].size()).copy_(at::tensor(kPrompts[b], at::kLong));
    valid.push_back(kPrompts[b].size());
  }
  return {t, valid};
}

// One paged, packed call's arguments (the engine's): every prompt's tokens
// in one row, each prompt in its own blocks of 4.
struct Packed {
  at::Tensor tokens;
  std::vector<int64_t> valid;
  std::vector<std::vector<int64_t>> tables;
};
Packed packed() {
  Packed out;
  std::vector<int64_t> flat;
  int64_t next = 0;
  for (const auto& p : kPrompts) {
    flat.insert(flat.end(), p.begin(), p.end());
    out.valid.push_back(p.size());
    std::vector<int64_t> table;
    for (int64_t i = 0; i < (static_cast<int64_t>(p.size()) + kDecodeSteps + 3) / 4; ++i) table.push_back(next++);
    out.tables.push_back(table);
  }
  out.tokens = at::tensor(flat, at::kLong).view({1, -1});
  return out;
}

// What a CommCounter saw, kept after it is gone.
struct Counts {
  std::array<int64_t, kNumCollectiveTypes> n{};
  std::string text;
  int64_t count(CollectiveType t) const { return n[static_cast<size_t>(t)]; }
  int64_t total() const {
    int64_t sum = 0;
    for (int64_t x : n) sum += x;
    return sum;
  }
};
Counts snapshot(const CommCounter& c) {
  Counts out;
  for (size_t t = 0; t < kNumCollectiveTypes; ++t) out.n[t] = c.count(static_cast<CollectiveType>(t));
  out.text = c.str();
  return out;
}

// The logits of the prefill and of kDecodeSteps greedy decode steps after
// it, [steps + 1][B, vocab], through the engine's model: on a contiguous
// cache (`paged` false) or a paged cache fed packed calls, its blocks over
// the cp ranks where the engine's model says so (ContextParallelOptions::
// kv_cache). `first_chunk` > 0 prefills in two packed calls, each prompt's
// first `first_chunk` tokens then the rest (the second continues cached
// tokens, so it never runs over cp). The messages of the prefill and of
// the first decode step (the model's alone: gathering vocabulary-sharded
// logits here is not counted).
std::vector<at::Tensor> prefillAndDecode(Llama& model, bool paged, Counts* prefill_comm = nullptr,
                                         Counts* decode_comm = nullptr, int64_t first_chunk = 0) {
  at::NoGradGuard no_grad;
  const auto engine = engine_model(model);
  const int64_t batch = static_cast<int64_t>(kPrompts.size());
  KVCache cache = paged ? KVCache::paged(64, 4) : KVCache(batch, model->config.max_seq_len);
  if (paged && engine->kv_cache_group().valid()) cache.shard_blocks(engine->kv_cache_group());
  const Packed p = packed();
  std::vector<int64_t> lengths(batch, 0);
  auto full = [](at::Tensor logits) { return (is_dtensor(logits) ? full_tensor(logits) : logits).squeeze(1); };
  std::vector<at::Tensor> out;
  at::Tensor logits;
  {
    CommCounter comm;
    if (paged && first_chunk > 0) {
      // Each prompt's tokens [from, to) in one packed call.
      auto part = [&](int64_t from, int64_t to) {
        std::vector<int64_t> flat, valid;
        for (const auto& prompt : kPrompts) {
          const int64_t end = std::min<int64_t>(to, prompt.size());
          flat.insert(flat.end(), prompt.begin() + from, prompt.begin() + end);
          valid.push_back(end - from);
        }
        cache.set_batch(p.tables, lengths, /*packed=*/true);
        logits = engine->forward(at::tensor(flat, at::kLong).view({1, -1}), cache, valid);
        for (int64_t b = 0; b < batch; ++b) lengths[b] += valid[b];
      };
      part(0, first_chunk);
      part(first_chunk, model->config.max_seq_len);
    } else if (paged) {
      cache.set_batch(p.tables, lengths, /*packed=*/true);
      logits = engine->forward(p.tokens, cache, p.valid);
    } else {
      cache.reset(batch);
      const auto [tokens, valid] = padded();
      logits = engine->forward(tokens, cache, valid);
    }
    if (prefill_comm) *prefill_comm = snapshot(comm);
  }
  out.push_back(full(logits));
  lengths = p.valid;
  for (int64_t step = 0; step < kDecodeSteps; ++step) {
    const at::Tensor next = out.back().argmax(-1).view({batch, 1});
    {
      CommCounter comm;
      if (paged) cache.set_batch(p.tables, lengths, /*packed=*/true);
      logits = engine->forward(paged ? next.view({1, batch}) : next, cache, std::vector<int64_t>(batch, 1));
      if (decode_comm && step == 0) *decode_comm = snapshot(comm);
    }
    out.push_back(full(logits));
    for (auto& n : lengths) ++n;
  }
  if (paged && cache.is_sharded()) {  // each rank allocated its share of the 64 blocks only
    const int64_t cp = cache.shard_group().size();
    EXPECT_EQ(cache.local_blocks(), (64 + cp - 1) / cp);
    const inference::KvShape kv = engine->kv_shape();
    const at::Tensor like = at::empty({1, 1, kv.local_heads, kv.head_dim}, at::TensorOptions().dtype(kv.dtype));
    EXPECT_EQ(cache.layer(0, like).first.size(0), cache.local_blocks() * 4) << "slots of layer 0 on this rank";
  }
  return out;
}

struct Layout {
  std::string what;
  int64_t cp = 2, tp = 1;
  ContextParallelOptions options;
  LlamaConfig config = ::config();
};

// Mistral's sliding window, shorter than the prompts: the prefill's ring
// hides the keys window or more positions back, and decode reads the
// gathered cache under the same window.
LlamaConfig mistral(int64_t window) {
  LlamaConfig c = config();
  c.family = "mistral";
  c.sliding_window = window;
  return c;
}

// This rank's model of layout l (inside run_ranks): tp for inference, then cp.
Llama rankModel(const Layout& l) {
  const DeviceMesh mesh = init_device_mesh("cpu", {l.cp, l.tp}, {"cp", "tp"});
  Llama model(l.config);
  model->eval();
  if (l.tp > 1) apply_tensor_parallel_for_inference(model, mesh["tp"]);
  apply_context_parallel(model, mesh["cp"], l.options);
  return model;
}

void expectPrefillEqualsOneDevice(const Layout& l) {
  SCOPED_TRACE(l.what);
  const LlamaConfig& c = l.config;
  std::vector<at::Tensor> want[2];
  {
    Llama one(c);
    one->eval();
    for (const bool paged : {false, true}) want[paged] = prefillAndDecode(one, paged);
  }
  std::mutex mu;
  double worst = 0;
  run_ranks(static_cast<int>(l.cp * l.tp), [&](int rank) {
    SCOPED_TRACE(l.what + " rank " + std::to_string(rank));
    Llama model = rankModel(l);
    double err = 0;
    for (const bool paged : {false, true}) {
      SCOPED_TRACE(paged ? "paged, packed" : "contiguous");
      Counts prefill, decode;
      const auto got = prefillAndDecode(model, paged, &prefill, &decode);
      ASSERT_EQ(got.size(), want[paged].size());
      for (size_t s = 0; s < got.size(); ++s) {
        const double d = (got[s] - want[paged][s]).abs().max().item<double>();
        EXPECT_LE(d, kTol) << (s == 0 ? "prefill" : "decode step " + std::to_string(s)) << " logits";
        err = std::max(err, d);
      }
      const int64_t L = c.n_layers, cp = l.cp;
      const bool ring = l.options.attention == ContextParallelAttention::Ring;
      EXPECT_EQ(prefill.count(CollectiveType::Send), ring ? L * (cp - 1) : 0) << prefill.text;
      EXPECT_EQ(prefill.count(CollectiveType::Recv), ring ? L * (cp - 1) : 0) << prefill.text;
      EXPECT_EQ(prefill.count(CollectiveType::AllToAll), ring ? 0 : 4 * L) << prefill.text;
      EXPECT_EQ(prefill.count(CollectiveType::AllGather), L) << "one all_gather of k and v per layer; " << prefill.text;
      // The last tokens over cp (1); under TP an all_reduce after the
      // embedding and after each attention and MLP (2L + 1).
      EXPECT_EQ(prefill.count(CollectiveType::AllReduce), 1 + (l.tp > 1 ? 2 * L + 1 : 0)) << prefill.text;
      EXPECT_EQ(prefill.total(), prefill.count(CollectiveType::Send) + prefill.count(CollectiveType::Recv) +
                                     prefill.count(CollectiveType::AllToAll) + L + 1 + (l.tp > 1 ? 2 * L + 1 : 0))
          << prefill.text;
      // A decode step: nothing at cp alone; under TP as without cp (2L + 1).
      EXPECT_EQ(decode.total(), l.tp > 1 ? 2 * L + 1 : 0) << "a decode step on the gathered cache: " << decode.text;
    }
    std::lock_guard<std::mutex> lock(mu);
    worst = std::max(worst, err);
  });
  std::printf("  %s: max |prefill and decode logits - one device| %.3g\n", l.what.c_str(), worst);
}

ContextParallelOptions sharded(ContextParallelOptions o) {
  o.kv_cache = CpKvCache::Sharded;
  return o;
}

// The paged cache's blocks over the cp ranks (NOTE: [KV cache sharded over
// cp]): prefill and decode logits against one device's, each rank holding
// 64 / cp blocks. A decode step merges each layer's partial attention in one
// all_gather; `first_chunk` > 0 prefills in two calls, the second (and the
// first, when shorter than 2 * cp) attending over the shards.
void expectShardedCacheEqualsOneDevice(const Layout& l, int64_t first_chunk = 0) {
  SCOPED_TRACE(l.what);
  const LlamaConfig& c = l.config;
  std::vector<at::Tensor> want;
  {
    Llama one(c);
    one->eval();
    want = prefillAndDecode(one, /*paged=*/true, nullptr, nullptr, first_chunk);
  }
  std::mutex mu;
  double worst = 0;
  run_ranks(static_cast<int>(l.cp * l.tp), [&](int rank) {
    SCOPED_TRACE(l.what + " rank " + std::to_string(rank));
    Llama model = rankModel(l);
    ASSERT_TRUE(engine_model(model)->kv_cache_group().valid()) << "the engine's model spreads no cache";
    Counts prefill, decode;
    const auto got = prefillAndDecode(model, /*paged=*/true, &prefill, &decode, first_chunk);
    ASSERT_EQ(got.size(), want.size());
    double err = 0;
    for (size_t s = 0; s < got.size(); ++s) {
      const double d = (got[s] - want[s]).abs().max().item<double>();
      EXPECT_LE(d, kTol) << (s == 0 ? "prefill" : "decode step " + std::to_string(s)) << " logits";
      err = std::max(err, d);
    }
    const int64_t L = c.n_layers, tpReduce = l.tp > 1 ? 2 * L + 1 : 0;
    // The prefill over cp gathers each layer's keys and values (L); a call
    // on the shards merges each layer's attention (L). Chunked: two calls.
    EXPECT_EQ(prefill.count(CollectiveType::AllGather), first_chunk > 0 ? 2 * L : L) << prefill.text;
    EXPECT_EQ(decode.count(CollectiveType::AllGather), L) << "one merge per layer; " << decode.text;
    EXPECT_EQ(decode.total(), L + tpReduce) << decode.text;
    std::lock_guard<std::mutex> lock(mu);
    worst = std::max(worst, err);
  });
  std::printf("  %s: max |prefill and decode logits - one device| %.3g\n", l.what.c_str(), worst);
}

TEST(CpGenerateTest, ShardedCacheEqualsOneDevice) {
  expectShardedCacheEqualsOneDevice({"sharded, cp 2, ring, HeadTail", 2, 1, sharded(cp_ring())});
  expectShardedCacheEqualsOneDevice({"sharded, cp 4, ring, HeadTail", 4, 1, sharded(cp_ring())});
  expectShardedCacheEqualsOneDevice({"sharded, cp 2, all-to-all, Contiguous", 2, 1,
                                     sharded(cp_all_to_all(CpLayout::Contiguous))});
  expectShardedCacheEqualsOneDevice({"sharded, (cp, tp) = (2, 2), ring", 2, 2, sharded(cp_ring())});
  expectShardedCacheEqualsOneDevice({"sharded, mistral window 3, cp 2, ring", 2, 1, sharded(cp_ring()), mistral(3)});
  expectShardedCacheEqualsOneDevice({"sharded, mistral window 5, cp 4, ring", 4, 1, sharded(cp_ring()), mistral(5)});
  // 6 tokens then the rest: over cp then on the shards (cp 2); on the
  // shards twice (cp 4: 6 < 2 * cp).
  expectShardedCacheEqualsOneDevice({"sharded, chunked 6 + rest, cp 2", 2, 1, sharded(cp_ring())}, 6);
  expectShardedCacheEqualsOneDevice({"sharded, chunked 6 + rest, cp 4", 4, 1, sharded(cp_ring())}, 6);
}

TEST(CpGenerateTest, PrefillLogitsAndCacheEqualOneDevice) {
  expectPrefillEqualsOneDevice({"cp 2, ring, HeadTail", 2, 1, cp_ring()});
  expectPrefillEqualsOneDevice({"cp 2, ring, Contiguous", 2, 1, cp_ring(CpLayout::Contiguous)});
  expectPrefillEqualsOneDevice({"cp 4, ring, HeadTail", 4, 1, cp_ring()});
  expectPrefillEqualsOneDevice({"cp 2, all-to-all", 2, 1, cp_all_to_all()});
  expectPrefillEqualsOneDevice({"(cp, tp) = (2, 2), ring", 2, 2, cp_ring()});
  expectPrefillEqualsOneDevice({"mistral window 5, cp 2, ring, HeadTail", 2, 1, cp_ring(), mistral(5)});
  expectPrefillEqualsOneDevice({"mistral window 3, cp 4, ring, HeadTail", 4, 1, cp_ring(), mistral(3)});
  expectPrefillEqualsOneDevice({"mistral window 6, cp 2, all-to-all", 2, 1, cp_all_to_all(), mistral(6)});
}

// generate (the engine: one packed prefill of every prompt, then decode):
// the same greedy tokens as one device, and the prefill ran over cp (its
// ring messages counted). A prompt shorter than 2 * cp prefills as without
// cp (no message) and still equals one device.
TEST(CpGenerateTest, GreedyTokensEqualOneDevice) {
  const LlamaConfig c = config();
  GenerateOptions o;
  o.max_new_tokens = 8;
  std::vector<std::vector<int64_t>> shortPrompt = {{4, 8, 15}};
  Llama one(c);
  const auto want = generate(one, kPrompts, o), want_short = generate(one, shortPrompt, o);
  run_ranks(2, [&](int) {
    Llama model(c);
    apply_context_parallel(model, init_device_mesh("cpu", {2}, {"cp"}));
    CommCounter comm;
    EXPECT_EQ(generate(model, kPrompts, o), want);
    EXPECT_EQ(comm.count(CollectiveType::Send), c.n_layers) << "the prefill's ring, cp - 1 per layer: " << comm.str();
    comm.reset();
    EXPECT_EQ(generate(model, shortPrompt, o), want_short);
    EXPECT_EQ(comm.count(CollectiveType::Send), 0) << "3 tokens < 2 * cp: prefilled without cp; " << comm.str();
  });
}

// NOTE: [KV cache sharded over cp]'s rule on 5 blocks of 4 over 2 ranks:
// block b on rank b % 2 as its local block b / 2. A sequence of 5 tokens in
// blocks {3, 0} decoding its 6th: the new token (block 0) is written on
// rank 0 only; keys 0-3 (block 3) are read on rank 1, 4 and 5 on rank 0.
// Sharding a contiguous cache, or one already allocated, is refused.
TEST(CpGenerateTest, ShardedCacheHoldsBlockBOnRankBModCp) {
  run_ranks(2, [](int rank) {
    const ProcessGroup group = init_device_mesh("cpu", {2}, {"cp"}).get_group(0);
    KVCache cache = KVCache::paged(5, 4);
    cache.shard_blocks(group);
    EXPECT_EQ(cache.local_blocks(), 3);
    cache.set_batch({{3, 0}}, {5});
    cache.begin({1}, 1);
    const KVCache::Step& step = cache.step();
    auto list = [](const at::Tensor& t) { return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel()); };
    using V = std::vector<int64_t>;
    EXPECT_EQ(list(step.write_slots), rank == 0 ? V{1} : V{});
    EXPECT_EQ(list(step.read_slots), (rank == 0 ? V{0, 0, 0, 0, 0, 1} : V{4, 5, 6, 7, 0, 0}));
    EXPECT_EQ(list(step.read_held.to(at::kLong)), (rank == 0 ? V{0, 0, 0, 0, 1, 1} : V{1, 1, 1, 1, 0, 0}));
    dtp::test::expect_error([&] { KVCache(1, 8).shard_blocks(group); }, {"this cache is contiguous", "KVCache::paged"});
    cache.layer(0, at::zeros({1, 1, 2, 4}));
    dtp::test::expect_error([&] { cache.shard_blocks(group); }, {"allocated its layers already", "before its first forward"});
  });
}

// The serving engine on a cache sharded over cp 2 (and cp 4): prompts
// prefilled 5 tokens per step beside decoding rows in packed steps, a
// repeated prompt served from the prefix cache, a pool of 14 blocks (each
// rank allocating its share) too small for every row, so rows are
// preempted and recomputed; the greedy tokens of one device's full
// recompute.
TEST(CpGenerateTest, EngineOnAShardedCacheDrawsOneDevicesTokens) {
  const LlamaConfig c = config();
  constexpr int64_t kNew = 8;
  std::vector<std::vector<int64_t>> prompts = kPrompts;
  prompts.push_back(kPrompts[2]);  // its first full blocks come from the prefix cache
  std::vector<std::vector<int64_t>> want;
  {
    Llama one(c);
    for (const auto& p : prompts) want.push_back(dtp::test::greedy_by_recompute(one, p, kNew));
  }
  inference::EngineOptions eo;
  eo.max_batch = 4;
  eo.block_size = 4;
  eo.prefill_chunk = 5;
  eo.prefix_caching = true;
  eo.kv_cache_blocks = 14;  // at least a whole context (12 blocks); fewer than 4 rows need: preemption
  for (const int cp : {2, 4}) {
    SCOPED_TRACE("cp " + std::to_string(cp));
    run_ranks(cp, [&](int) {
      Llama model(c);
      apply_context_parallel(model, init_device_mesh("cpu", {cp}, {"cp"}), sharded(cp_ring()));
      inference::Engine engine(engine_model(model), eo);
      EXPECT_EQ(engine.num_blocks(), 14);
      EXPECT_EQ(engine.local_blocks(), (14 + cp - 1) / cp);
      std::vector<int64_t> ids;
      for (const auto& p : prompts) ids.push_back(engine.enqueue(p, dtp::test::greedy_request(kNew)).id);
      std::vector<std::vector<int64_t>> got(prompts.size());
      CommCounter comm;
      while (engine.step()) {
        for (const inference::Output& o : engine.poll()) {
          const auto at = std::find(ids.begin(), ids.end(), o.id) - ids.begin();
          got[at].insert(got[at].end(), o.tokens.begin(), o.tokens.end());
        }
      }
      EXPECT_EQ(got, want);
      EXPECT_GT(engine.metrics().prefix_cache_hits, 0) << "the repeated prompt found no cached block";
      EXPECT_GT(engine.metrics().preemptions, 0) << "14 blocks held every row";
      // A budget per rank holds cp times the blocks.
      inference::EngineOptions mib = eo;
      mib.kv_cache_blocks = 0;
      mib.kv_cache_mib = 1;
      const inference::Engine budget(engine_model(model), mib);
      const int64_t per_rank = (int64_t{1} << 20) / budget.block_bytes();
      EXPECT_EQ(budget.num_blocks(), cp * per_rank);
      EXPECT_EQ(budget.local_blocks(), per_rank);
      EXPECT_GT(comm.count(CollectiveType::AllGather), 0) << comm.str();
    });
  }
}

// The KV-cache forward itself is not context-parallel: called directly on a
// cp model (not through generate or the engine's model), it refuses and
// names the two calls that prefill over cp.
TEST(CpGenerateTest, DirectCachedForwardNamesGenerateAndTheEngine) {
  const LlamaConfig c = config();
  run_ranks(2, [&](int) {
    Llama model(c);
    apply_context_parallel(model, init_device_mesh("cpu", {2}, {"cp"}));
    at::NoGradGuard no_grad;
    KVCache cache(1, c.max_seq_len);
    cache.reset(1);
    const auto [tokens, valid] = padded();
    try {
      model->forward(tokens.narrow(0, 0, 1), cache, {valid[0]});
      ADD_FAILURE() << "a KV-cache forward on a cp model ran";
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      EXPECT_NE(what.find("NYI: the KV cache under context parallelism"), std::string::npos) << what;
      EXPECT_NE(what.find("models::generate or the inference Engine"), std::string::npos) << what;
    }
  });
}

}  // namespace
