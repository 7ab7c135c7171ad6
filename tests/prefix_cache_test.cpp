// Prefix caching (EngineOptions::prefix_caching; NOTE: [Prefix cache] in
// src/inference/block_pool.h) through the engine's public API only, on the
// tiny float64 Llama: many requests share a long prefix (several blocks of
// 4) with different suffixes, and arrive after earlier ones have prefilled.
// Every request's tokens, greedy and seeded, with caching must equal the
// same requests' without it (and greedy ones a full recompute without any
// cache), at TP 1 and TP 2 (every rank planning alike, and a leader with a
// follower); the hit counter must be exactly the shared full blocks'
// tokens, and 0 without caching.
#include "dist.h"
#include "engine_util.h"

#include "dtp/inference/engine.h"
#include "dtp/models/engine_model.h"
#include "dtp/models/generate.h"  // apply_tensor_parallel_for_inference
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"

#include <atomic>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

using namespace dtp;
using namespace dtp::models;
using dtp::inference::Engine;
using dtp::inference::EngineMetrics;
using dtp::inference::EngineOptions;
using dtp::inference::Output;
using dtp::inference::RequestOptions;
using dtp::test::run_ranks;

namespace {

LlamaConfig config() { return dtp::test::tiny_engine_llama(/*max_seq_len=*/64); }  // a 26-token prompt and 8 tokens fit

constexpr int64_t kBlock = 4;
constexpr int64_t kPrefix = 22;  // 5 full blocks of 4 and 2 tokens
constexpr int64_t kSuffix = 4;   // prompts of 26 tokens: 6 full blocks and 2
constexpr int64_t kMaxTokens = 8;
constexpr size_t kRequests = 10;

std::vector<int64_t> sharedPrefix(int64_t n = kPrefix) {
  std::vector<int64_t> p;
  for (int64_t i = 0; i < n; ++i) p.push_back((37 * i + 11) % 256);
  return p;
}

// The shared prefix, then a suffix whose first token differs per request:
// no block past the prefix's 5 full ones is the same in two prompts (the
// 6th holds 2 prefix and 2 suffix tokens).
std::vector<std::vector<int64_t>> sharedPrefixPrompts(size_t n) {
  std::vector<std::vector<int64_t>> out;
  for (size_t i = 0; i < n; ++i) {
    std::vector<int64_t> p = sharedPrefix();
    for (int64_t k = 0; k < kSuffix; ++k) p.push_back((100 + 13 * static_cast<int64_t>(i) + 3 * k) % 256);
    out.push_back(p);
  }
  return out;
}

RequestOptions greedy(int64_t max_tokens = kMaxTokens) { return dtp::test::greedy_request(max_tokens); }
RequestOptions seeded(uint64_t seed) { return dtp::test::seeded_request(seed, kMaxTokens); }

std::vector<RequestOptions> allGreedy(size_t n) { return std::vector<RequestOptions>(n, greedy()); }
std::vector<RequestOptions> allSeeded(size_t n) {
  std::vector<RequestOptions> out;
  for (size_t i = 0; i < n; ++i) out.push_back(seeded(1000 + i));
  return out;
}

EngineOptions engineOptions(bool caching) {
  EngineOptions o;
  o.max_batch = 8;
  o.block_size = kBlock;
  o.prefix_caching = caching;
  return o;
}

struct Outcome {
  std::vector<std::vector<int64_t>> tokens;  // by request
  std::vector<int> finished;                 // finished outputs by request
  EngineMetrics metrics;
};

// Enqueues request i, then steps `gap` times before the next one (so that
// later requests arrive after earlier ones have prefilled), then steps
// until all are done. The same on every rank without a group.
Outcome runStaggered(Engine& engine, const std::vector<std::vector<int64_t>>& prompts,
                 const std::vector<RequestOptions>& ros, int gap) {
  std::mutex mu;
  Outcome run;
  run.tokens.resize(prompts.size());
  run.finished.assign(prompts.size(), 0);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto ticket = engine.enqueue(prompts[i], ros[i], [&, i](const Output& o) {
      std::lock_guard<std::mutex> lk(mu);
      run.tokens[i].insert(run.tokens[i].end(), o.tokens.begin(), o.tokens.end());
      run.finished[i] += o.finished;
    });
    EXPECT_TRUE(ticket.ok()) << "request " << i << ": " << ticket.why;
    for (int s = 0; s < gap; ++s) engine.step();
  }
  while (engine.step()) {
  }
  run.metrics = engine.metrics();
  return run;
}

Outcome runAtTp1(const EngineOptions& eo, const std::vector<std::vector<int64_t>>& prompts,
             const std::vector<RequestOptions>& ros, int gap) {
  Llama model(config());
  Engine engine(engine_model(model), eo);
  return runStaggered(engine, prompts, ros, gap);
}

// At TP 2 with `group`: rank 0 leads (enqueues and steps as at TP 1, then
// serves with stop set, which shuts the follower down) and rank 1 follows.
// Without: both ranks enqueue and step alike, and their runs must agree.
// Returns rank 0's run.
Outcome runAtTp2(bool group, const EngineOptions& eo, const std::vector<std::vector<int64_t>>& prompts,
             const std::vector<RequestOptions>& ros, int gap) {
  Outcome runs[2];
  run_ranks(2, [&](int rank) {
    Llama model(config());
    apply_tensor_parallel_for_inference(model, init_device_mesh("cpu", {2}, {"tp"}));
    std::optional<ProcessGroup> g;
    if (group) g = default_process_group();
    Engine engine(engine_model(model), eo, g);
    if (group && rank != 0) {
      EXPECT_EQ(engine.follow(), 0) << "follower";
      return;
    }
    runs[rank] = runStaggered(engine, prompts, ros, gap);
    if (group) {
      const std::atomic<bool> stop{true};
      EXPECT_EQ(engine.serve(stop), 0) << "leader's shutdown";
    }
  });
  if (!group) {
    EXPECT_EQ(runs[1].tokens, runs[0].tokens) << "rank 1's tokens vs rank 0's (no group)";
    EXPECT_EQ(runs[1].metrics.prefix_cache_hits, runs[0].metrics.prefix_cache_hits) << "rank 1's hits vs rank 0's";
  }
  return runs[0];
}

void expectSameTokens(const Outcome& cached, const Outcome& uncached, const std::string& what) {
  ASSERT_EQ(cached.tokens.size(), uncached.tokens.size()) << what;
  for (size_t i = 0; i < cached.tokens.size(); ++i) {
    EXPECT_EQ(cached.tokens[i], uncached.tokens[i]) << what << ": request " << i << " with caching vs without";
    EXPECT_EQ(cached.finished[i], 1) << what << ": request " << i << "'s finished outputs with caching";
    EXPECT_EQ(uncached.finished[i], 1) << what << ": request " << i << "'s finished outputs without caching";
    EXPECT_EQ(uncached.tokens[i].size(), static_cast<size_t>(kMaxTokens)) << what << ": request " << i;
  }
}

// Request 0 prefills alone; each later one finds the prefix's 5 full
// blocks (20 tokens) and computes its other 6 prompt tokens.
void expectSharedPrefixHits(const Outcome& cached, const Outcome& uncached, size_t n, const std::string& what) {
  EXPECT_EQ(cached.metrics.prefix_cache_queries, static_cast<int64_t>(n) * (kPrefix + kSuffix)) << what;
  EXPECT_EQ(cached.metrics.prefix_cache_hits, static_cast<int64_t>(n - 1) * (kPrefix / kBlock) * kBlock) << what;
  EXPECT_EQ(uncached.metrics.prefix_cache_queries, 0) << what << " without caching";
  EXPECT_EQ(uncached.metrics.prefix_cache_hits, 0) << what << " without caching";
  EXPECT_EQ(cached.metrics.kv_blocks_used, 0) << what << ": blocks held after all finished";
}

TEST(PrefixCacheTest, GreedySameTokensAsWithoutCachingAtTp1) {
  const auto prompts = sharedPrefixPrompts(kRequests);
  const auto ros = allGreedy(kRequests);
  // gap 2: the first requests still run (their blocks held by several)
  // when later ones arrive, the last ones after the first have finished
  // (their cached blocks held by no one).
  const Outcome off = runAtTp1(engineOptions(false), prompts, ros, 2);
  const Outcome on = runAtTp1(engineOptions(true), prompts, ros, 2);
  expectSameTokens(on, off, "greedy at TP 1");
  expectSharedPrefixHits(on, off, kRequests, "greedy at TP 1");
  Llama model(config());
  for (size_t i = 0; i < kRequests; ++i)
    EXPECT_EQ(on.tokens[i], dtp::test::greedy_by_recompute(model, prompts[i], kMaxTokens))
        << "request " << i << " vs a recompute";
}

TEST(PrefixCacheTest, SeededSameTokensAsWithoutCachingAtTp1) {
  const auto prompts = sharedPrefixPrompts(kRequests);
  const auto ros = allSeeded(kRequests);
  for (int gap : {1, 3}) {
    const Outcome off = runAtTp1(engineOptions(false), prompts, ros, gap);
    const Outcome on = runAtTp1(engineOptions(true), prompts, ros, gap);
    expectSameTokens(on, off, "seeded at TP 1, gap " + std::to_string(gap));
    expectSharedPrefixHits(on, off, kRequests, "seeded at TP 1, gap " + std::to_string(gap));
  }
}

TEST(PrefixCacheTest, SameTokensAsWithoutCachingAtTp2WithoutAGroup) {
  const auto prompts = sharedPrefixPrompts(kRequests);
  for (const auto& [what, ros] : {std::pair{"greedy", allGreedy(kRequests)}, std::pair{"seeded", allSeeded(kRequests)}}) {
    const Outcome off = runAtTp2(/*group=*/false, engineOptions(false), prompts, ros, 2);
    const Outcome on = runAtTp2(/*group=*/false, engineOptions(true), prompts, ros, 2);
    expectSameTokens(on, off, std::string(what) + " at TP 2 without a group");
    expectSharedPrefixHits(on, off, kRequests, std::string(what) + " at TP 2 without a group");
  }
}

TEST(PrefixCacheTest, SameTokensAsWithoutCachingAtTp2WithALeaderAndAFollower) {
  const auto prompts = sharedPrefixPrompts(kRequests);
  for (const auto& [what, ros] : {std::pair{"greedy", allGreedy(kRequests)}, std::pair{"seeded", allSeeded(kRequests)}}) {
    const Outcome off = runAtTp2(/*group=*/true, engineOptions(false), prompts, ros, 2);
    const Outcome on = runAtTp2(/*group=*/true, engineOptions(true), prompts, ros, 2);
    expectSameTokens(on, off, std::string(what) + " at TP 2 with a leader");
    expectSharedPrefixHits(on, off, kRequests, std::string(what) + " at TP 2 with a leader");
    // And the same as at TP 1 with caching.
    const Outcome tp1 = runAtTp1(engineOptions(true), prompts, ros, 2);
    EXPECT_EQ(on.tokens, tp1.tokens) << what << " at TP 2 vs TP 1";
  }
}

// A pool of 16 blocks of 4: each request needs 9 (26 prompt tokens and 8
// drawn), so with the 5 shared ones three run at once and their decoding
// outgrows the pool: the newest are preempted and recomputed, each time
// looking up its prompt and tokens so far in the cache again.
TEST(PrefixCacheTest, ATinyPoolPreemptsWithTheSameTokens) {
  const auto prompts = sharedPrefixPrompts(kRequests);
  for (const auto& [what, ros] : {std::pair{"greedy", allGreedy(kRequests)}, std::pair{"seeded", allSeeded(kRequests)}}) {
    EngineOptions off_o = engineOptions(false), on_o = engineOptions(true);
    off_o.kv_cache_blocks = on_o.kv_cache_blocks = 16;
    const Outcome off = runAtTp1(off_o, prompts, ros, 1);
    const Outcome on = runAtTp1(on_o, prompts, ros, 1);
    expectSameTokens(on, off, std::string(what) + " in a pool of 16 blocks");
    EXPECT_GT(on.metrics.preemptions, 0) << what << ": preemptions with caching";
    EXPECT_GT(on.metrics.prefix_cache_hits, 0) << what;
    EXPECT_EQ(on.metrics.kv_blocks_used, 0) << what << ": blocks held after all finished";
  }
}

// A pool of 12 blocks (context 48). A (26 tokens, 2 drawn) leaves its prompt's 6 full
// blocks cached; B (40 other tokens, 1 drawn) needs 10 blocks: the 6 free
// ones, then 4 cached ones, least recently given back first, and A gave
// back its tail first: A's blocks 5, 4, 3, 2 go. A' (A's prefix, another
// suffix) then finds blocks 0 and 1 only: 8 tokens. Its tokens, and B's,
// are those without caching.
TEST(PrefixCacheTest, ATinyPoolEvictsTheTailFirstWithTheSameTokens) {
  const auto ab = sharedPrefixPrompts(2);
  std::vector<int64_t> b;
  for (int64_t i = 0; i < 40; ++i) b.push_back((11 * i + 200) % 256);
  auto run = [&](bool caching, std::vector<int64_t>* hits_delta) {
    EngineOptions eo = engineOptions(caching);
    eo.context = 48;  // a pool holds at least one sequence of the context
    eo.kv_cache_blocks = 12;
    Llama model(config());
    Engine engine(engine_model(model), eo);
    Outcome r;
    const std::vector<std::vector<int64_t>> prompts = {ab[0], b, ab[1]};
    const std::vector<RequestOptions> ros = {greedy(2), greedy(1), greedy()};
    for (size_t i = 0; i < prompts.size(); ++i) {
      const int64_t before = engine.metrics().prefix_cache_hits;
      const Outcome one = runStaggered(engine, {prompts[i]}, {ros[i]}, 0);
      r.tokens.push_back(one.tokens[0]);
      r.finished.push_back(one.finished[0]);
      hits_delta->push_back(one.metrics.prefix_cache_hits - before);
    }
    r.metrics = engine.metrics();
    return r;
  };
  std::vector<int64_t> off_hits, on_hits;
  const Outcome off = run(false, &off_hits);
  const Outcome on = run(true, &on_hits);
  ASSERT_EQ(on.tokens.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(on.tokens[i], off.tokens[i]) << "request " << i << " with caching vs without";
    EXPECT_EQ(on.finished[i], 1) << "request " << i;
  }
  EXPECT_EQ(on.tokens[2].size(), static_cast<size_t>(kMaxTokens));
  EXPECT_EQ(on_hits, (std::vector<int64_t>{0, 0, 2 * kBlock})) << "hits of A, B and A'";
  EXPECT_EQ(off_hits, (std::vector<int64_t>{0, 0, 0}));
}

// A prompt of exactly 6 full blocks, cached whole by the first request:
// the same prompt again finds 5 (its last token is computed for its
// logits, so its whole last block is: NOTE: [Prefix cache]), and the
// prompt with 4 more tokens finds all 6. Greedy and seeded, at TP 1 and 2.
TEST(PrefixCacheTest, AWholePromptOfCachedBlocksRecomputesItsLastBlock) {
  const std::vector<int64_t> q = sharedPrefix(6 * kBlock);
  std::vector<int64_t> q4 = q;
  for (int64_t k = 0; k < kBlock; ++k) q4.push_back(250 - k);
  const std::vector<std::vector<int64_t>> prompts = {q, q, q4, q};
  const std::vector<RequestOptions> ros = {greedy(), greedy(), greedy(), seeded(7)};
  const Outcome off = runAtTp1(engineOptions(false), prompts, ros, 1);
  const Outcome on = runAtTp1(engineOptions(true), prompts, ros, 1);
  expectSameTokens(on, off, "a prompt of full blocks at TP 1");
  EXPECT_EQ(on.tokens[1], on.tokens[0]) << "the same greedy prompt twice";
  EXPECT_EQ(on.metrics.prefix_cache_queries, 3 * 24 + 28);
  EXPECT_EQ(on.metrics.prefix_cache_hits, 0 + 20 + 24 + 20);
  const Outcome on2 = runAtTp2(/*group=*/false, engineOptions(true), prompts, ros, 1);
  expectSameTokens(on2, off, "a prompt of full blocks at TP 2");
  EXPECT_EQ(on2.metrics.prefix_cache_hits, 0 + 20 + 24 + 20);
}

}  // namespace
