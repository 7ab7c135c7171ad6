// The serving engine as a library: continuous batching over a paged KV
// cache, with chunked prefill and preemption, for a model run with tensor
// parallelism (vLLM's EngineCore; TensorRT-LLM's Executor). dtp-serve is
// this engine behind HTTP; a C++ service embeds it the same way:
//
//   auto engine = std::make_shared<inference::Engine>(models::engine_model(model), options, group, &tokenizer);
//   RequestOptions ro;
//   ro.max_tokens = 64;
//   ro.stop_tokens = {eos};
//   inference::Ticket t = engine->enqueue(tokenizer.encode("Hello", true), ro,
//                                         [](const inference::Output& o) { std::cout << o.text; });
//   while (engine->step()) {}        // or: engine->serve(stop) on a thread of its own
//
// Ranks. Every rank of the model runs every step (the forwards are
// collective). With `group` (several ranks), its rank 0 is the leader: it
// alone takes requests (enqueue, cancel, poll), plans each step and
// broadcasts the plan; the other ranks call follow(), which runs the
// leader's plans until it shuts down. Without a group, each rank plans for
// itself: every rank then enqueues the same requests in the same order and
// calls step() alike (the plans are deterministic), as models::generate
// does.
//
// Outputs. After each step every request that drew a token gets one Output:
// its new tokens and the text they settle (with a tokenizer), and at the
// end its finish reason and usage. By callback (called on the thread that
// runs step(), after the step, outside the engine's lock: keep it short), or
// queued for poll() when the request has none.
//
// Threads. enqueue, cancel, poll and metrics may be called from any thread,
// while step(), serve() or follow() run on one.
//
// How a step runs: NOTE: [Serving step] in src/inference/model_runner.h.
#pragma once

#include "dtp/inference/histogram.h"
#include "dtp/inference/model.h"
#include "dtp/inference/sampling.h"
#include "dtp/process_group.h"

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dtp::models {
class Tokenizer;  // dtp/text/tokenizer.h
}  // namespace dtp::models

namespace dtp::inference {

struct EngineOptions {
  int64_t max_batch = 16;       // running sequences
  int64_t max_prefill = 4;      // sequences in one step's prefill forward
  int64_t prefill_chunk = 256;  // prompt tokens per step, over all sequences
  int64_t context = 0;          // tokens per sequence (prompt + output); 0: the model's max_seq_len
  int64_t block_size = 16;      // tokens per KV block
  // The pool's size per rank (0: max_batch sequences of `context`). A model
  // whose cache spreads over its cp ranks (Model::kv_cache_group) holds cp
  // times as many blocks in the same budget per rank.
  int64_t kv_cache_mib = 0;
  int64_t kv_cache_blocks = 0;  // or the pool's blocks (over all cp ranks)
  int64_t max_queue = 256;      // waiting requests before enqueue refuses (Refusal::kQueueFull)
  // vLLM's automatic prefix caching: full KV blocks are kept, keyed by their
  // tokens and prefix, and shared by later requests with the same prefix
  // (NOTE: [Prefix cache] in src/inference/block_pool.h).
  bool prefix_caching = false;
  // Decode rows and prefill chunks in one packed forward per step (vLLM
  // v1's; NOTE: [Packed batch] in kv_cache.h). false: two forwards, decode
  // rows then prefill rows, as the engine ran before: the same tokens,
  // kept to measure the difference (dtp-serve --two-forwards-per-step).
  bool one_forward_per_step = true;
};

// One request's sampling and stopping (vLLM's SamplingParams).
struct RequestOptions {
  SamplingOptions sampling;
  uint64_t seed = 0;                  // its own generator's: the same tokens alone or in any batch
  int64_t max_tokens = 16;            // tokens to draw at most
  std::vector<int64_t> stop_tokens;   // the sequence ends after one (it adds no text)
  std::vector<std::string> stop;      // stop strings: the text ends before the first (needs a tokenizer)
  bool skip_special_tokens = true;    // in the text
  // -1: none. k in [0, kMaxTopLogprobs]: each drawn token's logprob and the
  // k most likely tokens' (Output::logprobs), from the vocabulary-sharded
  // logits without gathering them (dtp/inference/sampling.h's logprobs()).
  int64_t logprobs = -1;
};

enum class FinishReason {
  kStop,       // a stop token or stop string
  kLength,     // max_tokens
  kCancelled,  // cancel()
  kError,      // the engine could not finish it (shutdown, a dead rank): Output::error says why
};
// OpenAI's spelling: "stop", "length", "abort", "error".
const char* finish_reason_name(FinishReason reason);

struct Output {
  int64_t id = 0;
  std::vector<int64_t> tokens;  // drawn since the last output (a stop token included)
  std::vector<TokenLogprobs> logprobs;  // one per token when RequestOptions::logprobs >= 0
  std::string text;             // the text they settle (empty without a tokenizer)
  bool finished = false;
  FinishReason finish_reason = FinishReason::kStop;  // when finished
  std::string error;                                 // when kError
  int64_t prompt_tokens = 0;                         // usage
  int64_t completion_tokens = 0;                     // tokens drawn so far
};
using OutputCallback = std::function<void(const Output&)>;

enum class Refusal { kNone, kQueueFull, kStopping, kDead };
struct Ticket {
  int64_t id = -1;
  Refusal refused = Refusal::kNone;
  std::string why;  // when refused
  bool ok() const { return refused == Refusal::kNone; }
};

struct EngineMetrics {
  int64_t requests = 0, finished = 0, failed = 0, rejected = 0, cancelled = 0;
  int64_t prompt_tokens = 0, generation_tokens = 0, steps = 0;
  int64_t waiting = 0, running = 0, preemptions = 0;
  int64_t kv_blocks_used = 0, kv_blocks_total = 0, kv_block_size = 0;
  int64_t prefix_cache_queries = 0;  // prompt tokens looked up in the prefix cache
  int64_t prefix_cache_hits = 0;     // of them, tokens found there (not computed)
  int64_t context_parallel_prefills = 0;  // forwards that prefilled over cp (Model::context_parallel_prefills)
  Histogram ttft;  // enqueue to first token
  Histogram itl;   // between a request's consecutive tokens
};

class Engine {
 public:
  // `tokenizer` (may be null: no text, no stop strings) must outlive the
  // engine. The KV pool is allocated here: a pool too large fails now.
  Engine(std::shared_ptr<Model> model, const EngineOptions& options, std::optional<ProcessGroup> group = std::nullopt,
         const models::Tokenizer* tokenizer = nullptr);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // A new request; the leader's (or, without a group, every rank's). A
  // prompt outside [1, context) tokens, ids outside the vocabulary, or
  // options out of range are errors; a full queue, a stopping or a dead
  // engine refuse it (Ticket::refused).
  Ticket enqueue(std::vector<int64_t> prompt, RequestOptions options, OutputCallback on_output = {});
  // Ends a request: its sequence leaves at the next step and it gets a last
  // Output with kCancelled. Unknown or finished ids are ignored.
  void cancel(int64_t id);
  // Outputs of requests enqueued without a callback, oldest first.
  std::vector<Output> poll();

  // One step (collective: see Ranks above). Returns whether requests remain
  // (waiting or running); a step with nothing to run returns false at once.
  // Rows that finished in a step leave (and free their KV blocks) at the
  // next one, so the step after the last request's last token still
  // returns true and runs no forward.
  bool step();
  // The leader's loop: steps while there is work, idles (telling the
  // followers now and then) while there is none. When `stop` is set,
  // waiting requests fail, running ones get `grace_s` seconds to finish,
  // then the followers are told to exit. Returns 0, or 1 when a step failed
  // (a rank died or a collective failed: every open request then fails
  // with kError saying so).
  int serve(const std::atomic<bool>& stop, double grace_s = 2.0);
  // Ranks other than the leader: run the leader's plans until it shuts
  // down (serve() returning 0; a leader that drove step() itself ends its
  // followers with serve() and `stop` already set). Returns 0, or 1 when a
  // step failed.
  int follow();
  // Every open request fails with kError and `why`, and every later
  // enqueue is refused with it (a watch that saw a rank die).
  void fail_all(const std::string& why);
  // Why the engine stopped serving (empty while it serves).
  std::string dead() const;

  EngineMetrics metrics() const;
  const EngineOptions& options() const;  // `context` filled in
  int64_t num_blocks() const;            // KV blocks of the pool
  int64_t local_blocks() const;          // of them, allocated on this rank (all, unless the cache is sharded over cp)
  int64_t block_bytes() const;           // K and V of one block over all layers, on this rank

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtp::inference
