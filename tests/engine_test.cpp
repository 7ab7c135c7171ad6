// The serving engine library through its public API only (enqueue, cancel,
// poll, step, serve, follow, fail_all, metrics), on the tiny float64 Llama.
// Every token is checked against an independent reference: greedy tokens
// are the argmax of a full forward over the whole sequence without any
// cache; seeded samples are the same request's alone in a big pool on one
// device. At TP 2 both modes run: a leader with a follower (a group), and
// every rank planning alike (no group).
#include "dist.h"
#include "engine_util.h"

#include "dtp/inference/engine.h"
#include "dtp/models/engine_model.h"
#include "dtp/models/generate.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/text/tokenizer.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

using namespace dtp;
using namespace dtp::models;
using dtp::inference::Engine;
using dtp::inference::EngineMetrics;
using dtp::inference::EngineOptions;
using dtp::inference::FinishReason;
using dtp::inference::Output;
using dtp::inference::Refusal;
using dtp::inference::RequestOptions;
using dtp::inference::Ticket;
using dtp::test::expect_error;
using dtp::test::run_ranks;

namespace {

LlamaConfig config() { return dtp::test::tiny_engine_llama(/*max_seq_len=*/32); }

const std::vector<std::vector<int64_t>> kPrompts = {
    {5, 9, 2}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {60, 61, 62, 63, 64}, {200, 7}};
constexpr int64_t kMaxTokens = 8;

std::vector<std::vector<int64_t>> greedyReference(const std::vector<std::vector<int64_t>>& prompts) {
  Llama model(config());
  std::vector<std::vector<int64_t>> out;
  for (const auto& p : prompts) out.push_back(dtp::test::greedy_by_recompute(model, p, kMaxTokens));
  return out;
}

const std::vector<std::vector<int64_t>>& reference() {
  static const auto ref = greedyReference(kPrompts);
  return ref;
}

RequestOptions greedy(int64_t max_tokens = kMaxTokens) { return dtp::test::greedy_request(max_tokens); }
RequestOptions seeded(uint64_t seed) { return dtp::test::seeded_request(seed, kMaxTokens); }

EngineOptions engineOptions() {
  EngineOptions o;
  o.max_batch = 8;
  o.block_size = 4;
  return o;
}

// What one request received, over all its outputs.
struct Collected {
  std::vector<int64_t> tokens;
  std::string text;
  int outputs = 0;
  int finished = 0;      // outputs marked finished
  int after_finish = 0;  // outputs after the finished one
  bool counts_ok = true; // every output's completion_tokens equals the tokens so far
  FinishReason reason = FinishReason::kError;
  std::string error;
  int64_t prompt_tokens = -1, completion_tokens = -1;
};

// Outputs by request index, from callbacks (any thread) or poll().
class Sink {
 public:
  inference::OutputCallback callback(size_t i) {
    return [this, i](const Output& o) { add(i, o); };
  }
  void add(size_t i, const Output& o) {
    std::lock_guard<std::mutex> lk(mu_);
    Collected& c = by_[i];
    c.after_finish += c.finished > 0;
    ++c.outputs;
    c.tokens.insert(c.tokens.end(), o.tokens.begin(), o.tokens.end());
    c.text += o.text;
    c.counts_ok = c.counts_ok && o.completion_tokens == static_cast<int64_t>(c.tokens.size());
    if (o.finished) {
      ++c.finished;
      ++finished_;
      c.reason = o.finish_reason;
      c.error = o.error;
      c.prompt_tokens = o.prompt_tokens;
      c.completion_tokens = o.completion_tokens;
      cv_.notify_all();
    }
  }
  Collected get(size_t i) {
    std::lock_guard<std::mutex> lk(mu_);
    return by_[i];
  }
  void wait_finished(int64_t n) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return finished_ >= n; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<size_t, Collected> by_;
  int64_t finished_ = 0;
};

std::vector<Collected> collect(Sink& sink, size_t n) {
  std::vector<Collected> out;
  for (size_t i = 0; i < n; ++i) out.push_back(sink.get(i));
  return out;
}

// Request i ended once, by `reason`, with `want` tokens and their usage.
void expectRequest(const Collected& c, const std::vector<int64_t>& want, FinishReason reason, size_t prompt_tokens,
                   const std::string& what) {
  EXPECT_EQ(c.tokens, want) << what;
  EXPECT_EQ(c.finished, 1) << what << ": finished outputs";
  EXPECT_EQ(c.after_finish, 0) << what << ": outputs after the finished one";
  EXPECT_TRUE(c.counts_ok) << what << ": an output's completion_tokens is not the count of tokens so far";
  EXPECT_EQ(c.reason, reason) << what << ": finish reason " << inference::finish_reason_name(c.reason);
  EXPECT_EQ(c.prompt_tokens, static_cast<int64_t>(prompt_tokens)) << what;
  EXPECT_EQ(c.completion_tokens, static_cast<int64_t>(want.size())) << what;
}

// Every request of `ros` (prompt i), by callback, stepped on one device.
std::vector<Collected> runOnOneDevice(const EngineOptions& eo, const std::vector<std::vector<int64_t>>& prompts,
                                      const std::vector<RequestOptions>& ros, EngineMetrics* metrics = nullptr) {
  Llama model(config());
  Engine engine(engine_model(model), eo);
  Sink sink;
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_TRUE(engine.enqueue(prompts[i], ros[i], sink.callback(i)).ok());
  while (engine.step()) {
  }
  if (metrics) *metrics = engine.metrics();
  return collect(sink, prompts.size());
}

// The same at TP 2: with `group`, rank 0 leads (steps until done, then
// serves with stop set, which shuts the follower down) and rank 1 follows;
// without, both ranks enqueue alike and step. Returns rank 0's outputs
// (without a group, rank 1's must equal them).
std::vector<Collected> runAtTp2(bool group, const EngineOptions& eo, const std::vector<std::vector<int64_t>>& prompts,
                                const std::vector<RequestOptions>& ros) {
  std::vector<std::vector<int64_t>> tokens[2];
  std::vector<Collected> out;
  std::mutex mu;
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
    Sink sink;
    for (size_t i = 0; i < prompts.size(); ++i) EXPECT_TRUE(engine.enqueue(prompts[i], ros[i], sink.callback(i)).ok());
    while (engine.step()) {
    }
    if (group) {
      const std::atomic<bool> stop{true};
      EXPECT_EQ(engine.serve(stop), 0) << "leader's shutdown";
    }
    std::lock_guard<std::mutex> lk(mu);
    for (size_t i = 0; i < prompts.size(); ++i) tokens[rank].push_back(sink.get(i).tokens);
    if (rank == 0) out = collect(sink, prompts.size());
  });
  if (!group) EXPECT_EQ(tokens[1], tokens[0]) << "rank 1's tokens vs rank 0's (no group)";
  return out;
}

std::vector<RequestOptions> allGreedy(size_t n) { return std::vector<RequestOptions>(n, greedy()); }

TEST(EngineTest, GreedyEqualsAFullRecomputeAtTp1) {
  EngineMetrics m;
  const auto got = runOnOneDevice(engineOptions(), kPrompts, allGreedy(kPrompts.size()), &m);
  for (size_t i = 0; i < kPrompts.size(); ++i)
    expectRequest(got[i], reference()[i], FinishReason::kLength, kPrompts[i].size(), "request " + std::to_string(i));
  EXPECT_EQ(m.requests, 4);
  EXPECT_EQ(m.finished, 4);
  EXPECT_EQ(m.generation_tokens, 4 * kMaxTokens);
  EXPECT_EQ(m.prompt_tokens, 3 + 11 + 5 + 2);
  EXPECT_EQ(m.kv_blocks_used, 0);
  // One prefill of all prompts, one token per step after it, and one step
  // more whose plan frees the finished rows' blocks.
  EXPECT_EQ(m.steps, kMaxTokens + 1);
}

TEST(EngineTest, GreedyEqualsAFullRecomputeAtTp2WithALeaderAndAFollower) {
  const auto got = runAtTp2(/*group=*/true, engineOptions(), kPrompts, allGreedy(kPrompts.size()));
  ASSERT_EQ(got.size(), kPrompts.size());
  for (size_t i = 0; i < kPrompts.size(); ++i)
    expectRequest(got[i], reference()[i], FinishReason::kLength, kPrompts[i].size(), "request " + std::to_string(i));
}

TEST(EngineTest, GreedyEqualsAFullRecomputeAtTp2WithoutAGroup) {
  const auto got = runAtTp2(/*group=*/false, engineOptions(), kPrompts, allGreedy(kPrompts.size()));
  ASSERT_EQ(got.size(), kPrompts.size());
  for (size_t i = 0; i < kPrompts.size(); ++i)
    expectRequest(got[i], reference()[i], FinishReason::kLength, kPrompts[i].size(), "request " + std::to_string(i));
}

// Each request draws from its own seeded generator: the same tokens alone,
// in a batch, and at TP 2 (vocabulary-sharded logits), in both modes.
TEST(EngineTest, SeededSamplingIsTheSameAloneInABatchAndAtTp2) {
  std::vector<RequestOptions> ros;
  for (size_t i = 0; i < kPrompts.size(); ++i) ros.push_back(seeded(11 + i));
  std::vector<std::vector<int64_t>> alone;
  for (size_t i = 0; i < kPrompts.size(); ++i)
    alone.push_back(runOnOneDevice(engineOptions(), {kPrompts[i]}, {ros[i]})[0].tokens);
  const auto batch = runOnOneDevice(engineOptions(), kPrompts, ros);
  const auto led = runAtTp2(/*group=*/true, engineOptions(), kPrompts, ros);
  const auto alike = runAtTp2(/*group=*/false, engineOptions(), kPrompts, ros);
  ASSERT_EQ(led.size(), kPrompts.size());
  ASSERT_EQ(alike.size(), kPrompts.size());
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    EXPECT_EQ(alone[i].size(), static_cast<size_t>(kMaxTokens));
    EXPECT_EQ(batch[i].tokens, alone[i]) << "request " << i << " in a batch vs alone";
    EXPECT_EQ(led[i].tokens, alone[i]) << "request " << i << " at TP 2 with a leader vs alone at TP 1";
    EXPECT_EQ(alike[i].tokens, alone[i]) << "request " << i << " at TP 2 without a group vs alone at TP 1";
  }
  EXPECT_NE(alone[0], reference()[0]) << "the sampled tokens are the greedy ones: the sampling is not exercised";
}

// A request without a callback has its outputs queued for poll(): the same
// tokens, one finished output, a stop token ending it (kStop) or max_tokens
// (kLength), with its usage.
TEST(EngineTest, OutputsByCallbackAndByPollAreTheSame) {
  Llama model(config());
  Engine engine(engine_model(model), engineOptions());
  const int64_t stop = reference()[1][2];
  std::vector<std::vector<int64_t>> want;  // the reference, up to and with the first stop token
  for (const auto& r : reference()) {
    auto end = std::find(r.begin(), r.end(), stop);
    want.emplace_back(r.begin(), end == r.end() ? end : end + 1);
  }
  RequestOptions o = greedy();
  o.stop_tokens = {stop};
  Sink by_callback, by_poll;
  std::map<int64_t, size_t> index;  // poll's ids
  const size_t n = kPrompts.size();
  for (size_t i = 0; i < n; ++i) {
    EXPECT_TRUE(engine.enqueue(kPrompts[i], o, by_callback.callback(i)).ok());
    const Ticket t = engine.enqueue(kPrompts[i], o);
    ASSERT_TRUE(t.ok()) << t.why;
    index[t.id] = i;
  }
  auto drain = [&] {
    for (const Output& p : engine.poll()) {
      ASSERT_TRUE(index.count(p.id)) << "poll gave an unknown id " << p.id;
      by_poll.add(index[p.id], p);
    }
  };
  while (engine.step()) drain();
  drain();
  EXPECT_TRUE(engine.poll().empty());
  for (size_t i = 0; i < n; ++i) {
    const auto reason = want[i].back() == stop ? FinishReason::kStop : FinishReason::kLength;
    expectRequest(by_callback.get(i), want[i], reason, kPrompts[i].size(), "by callback, request " + std::to_string(i));
    expectRequest(by_poll.get(i), want[i], reason, kPrompts[i].size(), "by poll, request " + std::to_string(i));
  }
  EXPECT_EQ(want[1].size(), 3u);
  EXPECT_EQ(by_poll.get(1).reason, FinishReason::kStop);
  EXPECT_EQ(by_poll.get(0).reason, FinishReason::kLength) << "the stop token is in request 0's reference too";
}

// cancel(): a running request and a waiting one each get one last output
// (kCancelled), the others' tokens are unchanged, and the blocks come back.
TEST(EngineTest, CancelEndsARunningAndAWaitingRequestOnce) {
  Llama model(config());
  EngineOptions eo = engineOptions();
  eo.max_batch = 2;  // requests 2 and 3 wait
  Engine engine(engine_model(model), eo);
  Sink sink;
  std::vector<int64_t> ids;
  for (size_t i = 0; i < kPrompts.size(); ++i) ids.push_back(engine.enqueue(kPrompts[i], greedy(), sink.callback(i)).id);
  ASSERT_TRUE(engine.step());  // prefill of 0 and 1: one token each
  EXPECT_EQ(engine.metrics().running, 2);
  EXPECT_EQ(engine.metrics().waiting, 2);
  engine.cancel(ids[0]);
  engine.cancel(ids[3]);
  engine.cancel(ids[0]);  // twice: still one last output
  engine.cancel(12345);   // unknown: ignored
  while (engine.step()) {
  }
  expectRequest(sink.get(0), {reference()[0][0]}, FinishReason::kCancelled, kPrompts[0].size(), "running, cancelled");
  expectRequest(sink.get(3), {}, FinishReason::kCancelled, kPrompts[3].size(), "waiting, cancelled");
  for (size_t i : {1, 2})
    expectRequest(sink.get(i), reference()[i], FinishReason::kLength, kPrompts[i].size(), "request " + std::to_string(i));
  engine.cancel(ids[1]);  // finished: ignored
  EXPECT_FALSE(engine.step());
  EXPECT_EQ(sink.get(1).outputs, kMaxTokens);
  const EngineMetrics m = engine.metrics();
  EXPECT_EQ(m.cancelled, 2);
  EXPECT_EQ(m.kv_blocks_used, 0);

  // Every running request cancelled: the next step frees all their blocks.
  Sink again;
  const int64_t a = engine.enqueue(kPrompts[1], greedy(), again.callback(0)).id;
  const int64_t b = engine.enqueue(kPrompts[2], greedy(), again.callback(1)).id;
  ASSERT_TRUE(engine.step());
  EXPECT_GT(engine.metrics().kv_blocks_used, 0);
  engine.cancel(a);
  engine.cancel(b);
  EXPECT_FALSE(engine.step());
  EXPECT_EQ(engine.metrics().kv_blocks_used, 0) << "the cancelled requests' blocks after the next step";
  EXPECT_EQ(engine.metrics().running, 0);
  for (size_t i : {0, 1}) {
    EXPECT_EQ(again.get(i).finished, 1);
    EXPECT_EQ(again.get(i).reason, FinishReason::kCancelled);
  }
}

// A pool of 6 blocks of 4 tokens holds one sequence of the context (20
// tokens: the longest prompt, 11, and 8 more) but not all four requests:
// the newest are preempted and recomputed, with the same greedy tokens and
// the same seeded samples.
TEST(EngineTest, PreemptionKeepsGreedyAndSeededTokens) {
  EngineOptions small = engineOptions();
  small.context = 20;
  small.kv_cache_blocks = 6;
  EngineMetrics m;
  const auto got = runOnOneDevice(small, kPrompts, allGreedy(kPrompts.size()), &m);
  EXPECT_GT(m.preemptions, 0) << "the pool is not too small";
  EXPECT_EQ(m.kv_blocks_total, 6);
  EXPECT_EQ(m.kv_blocks_used, 0);
  for (size_t i = 0; i < kPrompts.size(); ++i)
    expectRequest(got[i], reference()[i], FinishReason::kLength, kPrompts[i].size(), "greedy, request " + std::to_string(i));

  std::vector<RequestOptions> ros;
  for (size_t i = 0; i < kPrompts.size(); ++i) ros.push_back(seeded(21 + i));
  EngineMetrics ms;
  const auto sampled = runOnOneDevice(small, kPrompts, ros, &ms);
  EXPECT_GT(ms.preemptions, 0);
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    const auto alone = runOnOneDevice(engineOptions(), {kPrompts[i]}, {ros[i]});
    EXPECT_EQ(sampled[i].tokens, alone[0].tokens) << "seeded request " << i << " preempted vs alone in a big pool";
    EXPECT_EQ(sampled[i].finished, 1);
  }
}

// Prompts longer than prefill_chunk are prefilled over several steps.
TEST(EngineTest, ChunkedPrefillGivesTheSameTokens) {
  for (int64_t chunk : {1, 3, 5}) {
    EngineOptions eo = engineOptions();
    eo.prefill_chunk = chunk;
    EngineMetrics m;
    const auto got = runOnOneDevice(eo, kPrompts, allGreedy(kPrompts.size()), &m);
    for (size_t i = 0; i < kPrompts.size(); ++i)
      expectRequest(got[i], reference()[i], FinishReason::kLength, kPrompts[i].size(),
                    "prefill_chunk " + std::to_string(chunk) + ", request " + std::to_string(i));
    // The 11-token prompt alone takes ceil(11 / chunk) steps to its first token.
    EXPECT_GE(m.steps, (11 + chunk - 1) / chunk + kMaxTokens - 1) << "prefill_chunk " << chunk;
  }
}

// 8 threads enqueue 10 requests each while another serves: each finishes
// once with the reference tokens, then serve stops. A deadlock fails the
// test after minutes (a bound on hanging, not on speed).
TEST(EngineTest, ManyRequestsFromThreadsWhileServing) {
  constexpr int kThreads = 8, kPerThread = 10;
  std::vector<std::vector<int64_t>> prompts;
  for (int t = 0; t < kThreads; ++t) prompts.push_back({static_cast<int64_t>(10 + 20 * t), 3, static_cast<int64_t>(t)});
  const auto want = greedyReference(prompts);
  Llama model(config());
  EngineOptions eo = engineOptions();
  eo.max_batch = 16;
  Engine engine(engine_model(model), eo);
  Sink sink;
  std::atomic<bool> stop{false};
  std::atomic<int> refused{0};
  auto scenario = std::async(std::launch::async, [&] {
    std::thread server([&] { EXPECT_EQ(engine.serve(stop), 0); });
    std::vector<std::thread> clients;
    for (int t = 0; t < kThreads; ++t) {
      clients.emplace_back([&, t] {
        for (int k = 0; k < kPerThread; ++k) {
          const size_t i = static_cast<size_t>(t * kPerThread + k);
          if (!engine.enqueue(prompts[t], greedy(), sink.callback(i)).ok()) ++refused;
        }
      });
    }
    for (auto& c : clients) c.join();
    sink.wait_finished(kThreads * kPerThread - refused.load());
    stop = true;
    server.join();
  });
  if (scenario.wait_for(std::chrono::minutes(4)) != std::future_status::ready) {
    ADD_FAILURE() << "the engine did not finish 80 requests from 8 threads in 4 minutes: a deadlock";
    std::fflush(nullptr);
    std::_Exit(1);  // the threads hold the engine: no way to end the test cleanly
  }
  scenario.get();
  EXPECT_EQ(refused.load(), 0);
  for (int t = 0; t < kThreads; ++t)
    for (int k = 0; k < kPerThread; ++k)
      expectRequest(sink.get(t * kPerThread + k), want[t], FinishReason::kLength, prompts[t].size(),
                    "thread " + std::to_string(t) + ", request " + std::to_string(k));
  const EngineMetrics m = engine.metrics();
  EXPECT_EQ(m.requests, kThreads * kPerThread);
  EXPECT_EQ(m.finished, kThreads * kPerThread);
  EXPECT_EQ(m.kv_blocks_used, 0);
  EXPECT_EQ(engine.enqueue({1, 2}, greedy()).refused, Refusal::kStopping) << "after serve's stop";
}

TEST(EngineTest, RefusalsAndBadInputAreNamed) {
  Llama model(config());
  EngineOptions eo = engineOptions();
  eo.max_queue = 2;
  eo.context = 16;
  Engine engine(engine_model(model), eo);
  EXPECT_TRUE(engine.enqueue({1, 2}, greedy()).ok());
  EXPECT_TRUE(engine.enqueue({1, 2}, greedy()).ok());
  const Ticket full = engine.enqueue({1, 2}, greedy());
  EXPECT_EQ(full.refused, Refusal::kQueueFull);
  EXPECT_EQ(full.id, -1);
  EXPECT_NE(full.why.find("max_queue 2"), std::string::npos) << full.why;
  EXPECT_EQ(engine.metrics().rejected, 1);

  expect_error([&] { engine.enqueue(std::vector<int64_t>(16, 1), greedy(1)); },
               {"Engine::enqueue: the prompt: got 16 tokens, expected 1 to 15", "Shorten it"});
  expect_error([&] { engine.enqueue({}, greedy()); }, {"the prompt: got 0 tokens"});
  expect_error([&] { engine.enqueue({5, 256}, greedy()); },
               {"the prompt holds token 256", "[0, 256)", "vocabulary"});
  expect_error([&] { engine.enqueue({5, -1}, greedy()); }, {"the prompt holds token -1"});
  expect_error([&] { engine.enqueue({1, 2, 3}, greedy(14)); },
               {"max_tokens: got 14 with a prompt of 3 tokens, expected 1 to 13"});
  expect_error([&] { engine.enqueue({1, 2, 3}, greedy(0)); }, {"max_tokens: got 0"});
  RequestOptions stops = greedy();
  stops.stop = {"\n"};
  expect_error([&] { engine.enqueue({1, 2}, stops); }, {"stop strings need text", "without a tokenizer"});
  RequestOptions bad = greedy();
  bad.sampling.top_p = 0;
  expect_error([&] { engine.enqueue({1, 2}, bad); }, {"sampling: got temperature 0, top_k 0, top_p 0"});
  EXPECT_EQ(engine.metrics().requests, 2) << "a refused or bad request is not counted";
  EngineOptions long_context = engineOptions();
  long_context.context = 33;
  expect_error([&] { Engine e(engine_model(model), long_context); },
               {"EngineOptions::context: got 33", "max_seq_len 32"});
}

// fail_all ends every open request with its reason and refuses later ones;
// serve's stop fails the waiting requests (kError) and refuses new ones.
TEST(EngineTest, FailAllAndStopEndOpenRequests) {
  Llama model(config());
  {
    Engine engine(engine_model(model), engineOptions());
    Sink sink;
    engine.enqueue(kPrompts[0], greedy(), sink.callback(0));
    ASSERT_TRUE(engine.step());
    engine.enqueue(kPrompts[1], greedy(), sink.callback(1));  // waiting
    engine.fail_all("rank 1 died");
    for (size_t i : {0, 1}) {
      const Collected c = sink.get(i);
      EXPECT_EQ(c.finished, 1) << i;
      EXPECT_EQ(c.reason, FinishReason::kError) << i;
      EXPECT_EQ(c.error, "rank 1 died") << i;
    }
    EXPECT_EQ(sink.get(0).tokens, std::vector<int64_t>{reference()[0][0]});
    const Ticket t = engine.enqueue(kPrompts[2], greedy());
    EXPECT_EQ(t.refused, Refusal::kDead);
    EXPECT_EQ(t.why, "rank 1 died");
    EXPECT_EQ(engine.dead(), "rank 1 died");
    EXPECT_EQ(engine.metrics().failed, 2);
  }
  {
    Engine engine(engine_model(model), engineOptions());
    Sink sink;
    for (size_t i : {0, 1}) EXPECT_TRUE(engine.enqueue(kPrompts[i], greedy(), sink.callback(i)).ok());
    const std::atomic<bool> stop{true};
    EXPECT_EQ(engine.serve(stop), 0);
    for (size_t i : {0, 1}) {
      const Collected c = sink.get(i);
      EXPECT_EQ(c.finished, 1) << i;
      EXPECT_TRUE(c.tokens.empty()) << i;
      EXPECT_EQ(c.reason, FinishReason::kError) << i;
      EXPECT_NE(c.error.find("shutting down"), std::string::npos) << c.error;
    }
    EXPECT_EQ(engine.enqueue(kPrompts[2], greedy()).refused, Refusal::kStopping);
    EXPECT_TRUE(engine.dead().empty());
  }
}

// With a tokenizer: the texts concatenate to the decoded tokens (a stop
// token adds none), and a stop string ends the text before it (kStop).
TEST(EngineTest, TextIsTheDecodedTokensAndEndsBeforeAStopString) {
  ByteTokenizer tok;
  const std::vector<std::vector<int64_t>> prompts = {tok.encode("Hello", false), tok.encode("dtp", false)};
  const auto want = greedyReference(prompts);
  const std::string full0 = tok.decode(want[0]);
  const std::string stop_string = tok.decode({want[0][3], want[0][4]});
  const size_t cut = full0.find(stop_string);
  const int64_t stop_token = want[1][4];
  const size_t stop_at = std::find(want[1].begin(), want[1].end(), stop_token) - want[1].begin();

  Llama model(config());
  Engine engine(engine_model(model), engineOptions(), std::nullopt, &tok);
  Sink sink;
  RequestOptions with_stop_string = greedy();
  with_stop_string.stop = {"\x01\x02\x03 never", stop_string};
  RequestOptions with_stop_token = greedy();
  with_stop_token.stop_tokens = {stop_token};
  engine.enqueue(prompts[0], greedy(), sink.callback(0));
  engine.enqueue(prompts[0], with_stop_string, sink.callback(1));
  engine.enqueue(prompts[1], with_stop_token, sink.callback(2));
  while (engine.step()) {
  }
  const Collected plain = sink.get(0), stopped = sink.get(1), stop_tokened = sink.get(2);
  expectRequest(plain, want[0], FinishReason::kLength, prompts[0].size(), "no stop");
  EXPECT_EQ(plain.text, full0);
  EXPECT_GT(plain.outputs, 1);

  EXPECT_EQ(stopped.text, full0.substr(0, cut)) << "the text ends before the stop string";
  EXPECT_EQ(stopped.reason, FinishReason::kStop);
  EXPECT_EQ(stopped.finished, 1);
  EXPECT_EQ(stopped.after_finish, 0);
  EXPECT_LE(stopped.tokens.size(), 5u);
  EXPECT_EQ(stopped.tokens, std::vector<int64_t>(want[0].begin(), want[0].begin() + stopped.tokens.size()));

  const std::vector<int64_t> to_stop(want[1].begin(), want[1].begin() + stop_at + 1);
  expectRequest(stop_tokened, to_stop, FinishReason::kStop, prompts[1].size(), "stop token");
  EXPECT_EQ(stop_tokened.text, tok.decode(std::vector<int64_t>(to_stop.begin(), to_stop.end() - 1)))
      << "the stop token adds no text";
}

}  // namespace
