// Inference with the reference Llama: the KV cache equals a full recompute in
// float64 for a batch of prompts of different lengths; greedy and seeded
// top-k/top-p generation give the same tokens at TP=1, 2 and 4; a decode
// step's collectives equal the closed form; bad input is a named error.
#include "dist.h"

#include "dtensor/sharding_prop.h"

#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/inference/sampling.h"
#include "dtp/models/generate.h"
#include "dtp/models/parallelize.h"

#include <limits>
#include <mutex>

using namespace dtp;
using namespace dtp::models;
using dtp::test::expect_error;
using dtp::test::run_ranks;

namespace {

LlamaConfig config() {
  LlamaConfig c;
  c.vocab_size = 67;  // uneven over 2 and 4 ranks
  c.dim = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 4;
  c.ffn_hidden = 40;
  c.max_seq_len = 32;
  c.seed = 3;
  c.dtype = at::kDouble;
  return c;
}

const std::vector<std::vector<int64_t>> kPrompts = {{5, 9, 2}, {1, 2, 3, 4, 5, 6, 7}, {60, 61, 62, 63, 64}};

// The logits of the last token of `tokens` by a full forward without cache.
at::Tensor recompute(Llama& model, const std::vector<int64_t>& tokens) {
  at::NoGradGuard no_grad;
  at::Tensor t = at::tensor(tokens, at::kLong).view({1, -1});
  at::Tensor logits = model(t);
  if (is_dtensor(logits)) logits = full_tensor(logits);
  return logits[0][static_cast<int64_t>(tokens.size()) - 1];
}

// Prefill, then 4 decode steps of the greedy tokens: every step's logits
// equal a full recompute of the sequence so far.
TEST(KvCacheTest, DecodeEqualsAFullRecomputeInFloat64) {
  Llama model(config());
  model->eval();
  KVCache cache(4, 16);
  cache.reset(3);
  at::NoGradGuard no_grad;
  std::vector<std::vector<int64_t>> seqs = kPrompts;
  at::Tensor tokens = at::zeros({3, 7}, at::kLong);
  std::vector<int64_t> valid;
  for (int64_t b = 0; b < 3; ++b) {
    tokens[b].narrow(0, 0, seqs[b].size()).copy_(at::tensor(seqs[b], at::kLong));
    valid.push_back(seqs[b].size());
  }
  at::Tensor logits = model->forward(tokens, cache, valid);
  double worst = 0;
  for (int step = 0; step < 5; ++step) {
    std::vector<int64_t> next;
    for (int64_t b = 0; b < 3; ++b) {
      const at::Tensor want = recompute(model, seqs[b]);
      worst = std::max(worst, (logits[b][0] - want).abs().max().item<double>());
      next.push_back(want.argmax().item<int64_t>());
      seqs[b].push_back(next.back());
    }
    if (step < 4) logits = model->forward(at::tensor(next, at::kLong).view({3, 1}), cache, {1, 1, 1});
  }
  EXPECT_LE(worst, 1e-12) << "cached decode vs full recompute";
  EXPECT_EQ(cache.lengths(), (std::vector<int64_t>{7, 11, 9}));
  std::printf("KV cache vs full recompute, float64, prompts of 3, 7 and 5 tokens, 4 decode steps: max |diff| %.2g\n", worst);
}

std::vector<std::vector<int64_t>> generateAt(int tp, const GenerateOptions& o) {
  if (tp == 1) {
    Llama model(config());
    return generate(model, kPrompts, o);
  }
  std::vector<std::vector<int64_t>> out;
  std::mutex mu;
  run_ranks(tp, [&](int rank) {
    Llama model(config());
    apply_tensor_parallel_for_inference(model, init_device_mesh("cpu", {tp}, {"tp"}));
    GenerateOptions checked = o;
    checked.check_ranks_agree = true;
    auto got = generate(model, kPrompts, checked);
    std::lock_guard<std::mutex> lock(mu);
    if (rank == 0) out = got;
  });
  return out;
}

TEST(GenerateTest, GreedyAndSeededSamplingGiveTheSameTokensAtEveryTpDegree) {
  GenerateOptions greedy;
  greedy.max_new_tokens = 8;
  GenerateOptions sampled = greedy;
  sampled.sampling.temperature = 0.9;
  sampled.sampling.top_k = 10;
  sampled.sampling.top_p = 0.8;
  sampled.seed = 5;
  GenerateOptions full = sampled;  // no top-k: the whole vocabulary is gathered
  full.sampling.top_k = 0;
  full.sampling.top_p = 1.0;
  for (const auto& [name, o] : {std::make_pair("greedy", greedy), std::make_pair("top-k top-p", sampled),
                                std::make_pair("temperature", full)}) {
    SCOPED_TRACE(name);
    const auto one = generateAt(1, o);
    ASSERT_EQ(one.size(), 3u);
    for (const auto& s : one) EXPECT_EQ(s.size(), 8u);
    EXPECT_EQ(generateAt(2, o), one) << "TP=2";
    EXPECT_EQ(generateAt(4, o), one) << "TP=4";
  }
}

// GQA with tp > n_kv_heads (4 query heads, 2 KV heads, TP=4): KV heads are
// replicated, rank r attending with KV head r / 2, as vLLM does; greedy
// tokens equal one device's. tp = 3 (not a multiple of 2) is refused.
TEST(GenerateTest, TpAboveKvHeadsReplicatesKvHeads) {
  LlamaConfig c = config();
  c.n_kv_heads = 2;
  GenerateOptions o;
  o.max_new_tokens = 8;
  Llama one(c);
  const auto want = generate(one, kPrompts, o);
  std::vector<std::vector<int64_t>> got;
  run_ranks(4, [&](int rank) {
    Llama model(c);
    apply_tensor_parallel_for_inference(model, init_device_mesh("cpu", {4}, {"tp"}));
    EXPECT_EQ(model->layers[0]->as<dtp::nn::HookedImpl<TransformerBlockImpl>>()->attention->kv_head, rank / 2);
    auto out = generate(model, kPrompts, o);
    if (rank == 0) got = out;
  });
  EXPECT_EQ(got, want);
  LlamaConfig six = c;
  six.n_heads = 6;
  six.dim = 36;
  run_ranks(3, [&](int) {
    Llama m(six);
    expect_error([&] { apply_tensor_parallel_for_inference(m, init_device_mesh("cpu", {3}, {"tp"})); },
                 {"tp=3 > n_kv_heads=2", "multiple of n_kv_heads"});
  });
  // Training keeps refusing it, pointing at the inference plan.
  run_ranks(4, [&](int) {
    Llama m(c);
    expect_error([&] { apply_tensor_parallel(m, init_device_mesh("cpu", {4}, {"tp"})); },
                 {"n_kv_heads=2 is not divisible by the tp degree 4", "apply_tensor_parallel_for_inference"});
  });
}

// Stop tokens end a sequence after emitting one; the others go on.
// A finished sequence leaves the batch (its cache rows too): the others go on
// with the same tokens, at TP=1 and TP=2, and only they are computed.
TEST(GenerateTest, StopTokensEndEachSequenceOnItsOwn) {
  GenerateOptions o;
  o.max_new_tokens = 6;
  const auto free = generateAt(1, o);
  const int64_t stop = free[1][2];
  o.stop_tokens = {stop};
  for (int tp : {1, 2}) {
    const auto stopped = generateAt(tp, o);
    for (size_t b = 0; b < free.size(); ++b) {
      auto end = std::find(free[b].begin(), free[b].end(), stop);
      EXPECT_EQ(stopped[b], std::vector<int64_t>(free[b].begin(), end == free[b].end() ? end : end + 1))
          << "sequence " << b << ", TP=" << tp;
    }
    EXPECT_LE(stopped[1].size(), 3u);
  }
  Llama model(config());
  GenerateStats stats;
  const auto stopped = generate(model, kPrompts, o, &stats);
  int64_t decoded = 0;  // each sequence's tokens after the prefill's first
  for (const auto& s : stopped) decoded += static_cast<int64_t>(s.size()) - 1;
  EXPECT_EQ(stats.decode_sequences, decoded);
  EXPECT_LT(stats.decode_sequences, 3 * static_cast<int64_t>(stats.decode_ms.size()));
}

TEST(GenerateTest, KeepRowsThatAreNotAscendingIsANamedError) {
  KVCache cache(3, 8);
  cache.reset(3);
  dtp::test::expect_error([&] { cache.keep({2, 0}); }, {"KVCache::keep: rows [2, 0] must be ascending"});
}

// One decode step at TP=2 (no SP): an all-reduce after the embedding and
// after each attention and MLP, 2L + 1 of [B, 1, dim] float64; greedy
// sampling gathers one (logit, index) pair per sequence and rank.
TEST(GenerateTest, DecodeStepCollectivesMatchTheClosedForm) {
  const LlamaConfig c = config();
  run_ranks(2, [&](int) {
    Llama model(c);
    apply_tensor_parallel_for_inference(model, init_device_mesh("cpu", {2}, {"tp"}));
    KVCache cache(3, 16);
    cache.reset(3);
    at::NoGradGuard no_grad;
    model->forward(at::ones({3, 4}, at::kLong), cache, {4, 2, 3});
    CommCounter comm;
    at::Tensor logits = model->forward(at::ones({3, 1}, at::kLong), cache, {1, 1, 1});
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(0);
    inference::sample(logits, {}, gen);
    const int64_t B = 3, L = c.n_layers;
    EXPECT_EQ(comm.count(CollectiveType::AllReduce), 2 * L + 1);
    EXPECT_EQ(comm.bytes(CollectiveType::AllReduce), (2 * L + 1) * B * c.dim * 8);
    EXPECT_EQ(comm.count(CollectiveType::AllGather), 1);
    EXPECT_EQ(comm.bytes(CollectiveType::AllGather), 2 * B * 2 * 8);  // gathered output: 2 ranks x B x (logit, index)
    EXPECT_EQ(comm.total_count(), 2 * L + 2) << comm.str();
  });
}

// Greedy picks what at::argmax picks on the whole row: the first of equal
// logits (ties across and within shards), NaN above all, on vocabularies
// split evenly (2 ranks) and unevenly (4 ranks: 3, 3, 3, 1).
TEST(SamplingTest, GreedyPicksTheFirstOfEqualLogitsAsArgmax) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const at::Tensor logits = at::tensor({0.5, 1., 3., 0., 1., 2., 0., 3., 1., 0.,      // tie across shards: 2
                                        4., 4., 0., 1., 2., 3., 0., 0., 1., 2.,       // tie in shard 0: 0
                                        0., 1., 2., 3., 4., 5., 6., 7., nan, nan,     // NaN first: 8
                                        -1., -2., -3., -4., -5., -6., -7., -8., -9., -0.5},  // last: 9
                                       at::kDouble).view({4, 1, 10});
  const at::Tensor want = logits.view({4, 10}).argmax(-1);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(0);
  std::vector<int64_t> expected(want.data_ptr<int64_t>(), want.data_ptr<int64_t>() + 4);
  EXPECT_EQ(expected, (std::vector<int64_t>{2, 0, 8, 9}));
  EXPECT_EQ(inference::sample(logits, {}, gen), expected);
  for (int w : {2, 4}) {
    run_ranks(w, [&](int) {
      const DeviceMesh mesh = init_device_mesh("cpu", {w}, {"tp"});
      at::Generator g = at::make_generator<at::CPUGeneratorImpl>(0);
      EXPECT_EQ(inference::sample(distribute_tensor(logits, mesh, {Shard(2)}), {}, g), expected) << w << " ranks";
    });
  }
}

// Decode changes the attention's shapes at every token, but those run on
// local tensors: the sharding decisions cached per shape stop growing after
// the first steps (pytorch#181761 grew without bound), and nearly every
// DTensor op hits the cache.
TEST(GenerateTest, ShardingCacheStopsGrowingDuringDecode) {
  LlamaConfig c = config();
  c.max_seq_len = 1100;
  // 10 prompts of 1 to 10 tokens: 1000 decode steps are 10,000 decode tokens.
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t b = 0; b < 10; ++b) {
    prompts.emplace_back();
    for (int64_t t = 0; t <= b; ++t) prompts.back().push_back((7 * b + t) % c.vocab_size);
  }
  run_ranks(2, [&](int rank) {
    Llama model(c);
    apply_tensor_parallel_for_inference(model, init_device_mesh("cpu", {2}, {"tp"}));
    GenerateOptions o;
    o.max_new_tokens = 50;
    generate(model, prompts, o);
    const auto warm = propagation_cache_stats();
    o.max_new_tokens = 1001;
    GenerateStats stats;
    generate(model, prompts, o, &stats);
    ASSERT_EQ(stats.decode_sequences, 10000);
    const auto after = propagation_cache_stats();
    const double hitRate = static_cast<double>(after.hits - warm.hits) /
                           static_cast<double>(after.hits - warm.hits + after.misses - warm.misses);
    EXPECT_LE(after.size, warm.size + 8) << "entries added per prefill shape only, none per decode token";
    EXPECT_GE(hitRate, 0.999);
    if (rank == 0) {
      std::printf("sharding cache after 10000 more decode tokens (1000 steps of 10 sequences): %lld entries (after "
                  "the first 50 steps: %lld), hit rate %.5f\n", static_cast<long long>(after.size),
                  static_cast<long long>(warm.size), hitRate);
    }
  });
}

TEST(GenerateTest, BadInputIsANamedError) {
  Llama model(config());
  GenerateOptions o;
  o.max_new_tokens = 4;
  expect_error([&] { generate(model, {{1, 2}, {}}, o); }, {"prompt 1 is empty"});
  expect_error([&] { generate(model, {{1, 99}}, o); }, {"token 99", "vocabulary of 67"});
  LlamaConfig three = config();
  three.n_heads = 6;
  three.n_kv_heads = 3;
  three.dim = 36;
  run_ranks(4, [&](int) {
    Llama m(three);
    expect_error([&] { apply_tensor_parallel_for_inference(m, init_device_mesh("cpu", {4}, {"tp"})); },
                 {"n_heads=6 is not divisible by the tp degree 4"});
  });
  // A prompt longer than the model's rotary tables.
  expect_error([&] { generate(model, {std::vector<int64_t>(40, 1)}, o); },
               {"the longest prompt (40 tokens) plus max_new_tokens=4 is 44 positions", "attends 32 (max_seq_len)"});
}

}  // namespace
