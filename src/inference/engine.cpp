#include "dtp/inference/engine.h"

#include "dtp/text/tokenizer.h"

#include "model_runner.h"
#include "output_processor.h"
#include "scheduler.h"
#include "step_plan.h"

#include <c10/util/Exception.h>

#include <condition_variable>
#include <deque>
#include <iostream>
#include <mutex>

namespace dtp::inference {
namespace {

std::string messageOf(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

EngineOptions withContext(const EngineOptions& o, const Model& model) {
  EngineOptions out = o;
  if (out.context == 0) out.context = model.max_seq_len();
  TORCH_CHECK(out.context > 0 && out.context <= model.max_seq_len(), "dtp::inference::Engine: EngineOptions::context: "
              "got ", o.context, ", expected 1 to the model's max_seq_len ", model.max_seq_len(), " (0: all of it). "
              "Lower context (dtp-serve: --context).");
  TORCH_CHECK(out.max_queue > 0, "dtp::inference::Engine: EngineOptions::max_queue: got ", o.max_queue,
              ", expected a positive number of waiting requests.");
  out.max_prefill = std::min(out.max_prefill, out.max_batch);
  return out;
}

}  // namespace

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "abort";
    case FinishReason::kError: return "error";
  }
  return "error";
}

using Delivery = std::pair<std::shared_ptr<OutputState>, Output>;

struct Engine::Impl {
  Impl(std::shared_ptr<Model> m, const EngineOptions& o, std::optional<ProcessGroup> g, const models::Tokenizer* t)
      : model(std::move(m)),
        options(withContext(o, *model)),
        group(g && g->size() > 1 ? std::move(g) : std::nullopt),
        tokenizer(t),
        runner(*model, options),
        scheduler(runner),
        outputs(t) {
    metrics.kv_blocks_total = runner.blocks().total();
    metrics.kv_block_size = options.block_size;
  }

  bool leader() const { return !group || group->rank() == 0; }

  // Under mu: request `id`'s last output, queued for delivery.
  void endLocked(int64_t id, FinishReason reason, const std::string& error, std::vector<Delivery>& out) {
    if (auto d = outputs.end(id, reason, error)) {
      if (reason == FinishReason::kError) ++metrics.failed;
      out.push_back(std::move(*d));
    }
  }

  // Under mu: the waiting requests, then (or) the running ones, fail with
  // `why`; their rows leave at the next plan. Requests already finished
  // have had their last output.
  void failWaitingLocked(const std::string& why, std::vector<Delivery>& out) {
    for (auto& r : scheduler.drain_waiting()) failLocked(*r, why, out);
  }
  void failRunningLocked(const std::string& why, std::vector<Delivery>& out) {
    for (auto& r : scheduler.running()) failLocked(*r, why, out);
  }
  void failAllLocked(const std::string& why, std::vector<Delivery>& out) {
    failWaitingLocked(why, out);
    failRunningLocked(why, out);
  }
  void failLocked(SchedRequest& r, const std::string& why, std::vector<Delivery>& out) {
    if (r.finished) return;
    r.finished = true;
    endLocked(r.id, FinishReason::kError, why, out);
  }

  // Under mu: finished requests leave `open` (cancel ignores their ids).
  void forgetFinished() {
    for (auto it = open.begin(); it != open.end();) it = it->second->finished ? open.erase(it) : std::next(it);
  }

  // Outside mu: callbacks, or the poll queue.
  void deliver(std::vector<Delivery>& ds) {
    for (auto& [state, output] : ds) {
      if (state->callback) {
        state->callback(output);
      } else {
        std::lock_guard<std::mutex> lk(mu);
        polled.push_back(std::move(output));
      }
    }
    ds.clear();
  }

  // The plan of the next step (under mu), its run on every rank, and its
  // outputs. Returns the plan's op.
  int64_t stepOnce(std::unique_lock<std::mutex>& lk, StepPlan plan) {
    std::vector<Delivery> ds;
    // Requests cancelled while waiting or running end now: their rows leave
    // in this plan.
    for (int64_t id : cancelled_ids) endLocked(id, FinishReason::kCancelled, "", ds);
    cancelled_ids.clear();
    lk.unlock();
    deliver(ds);
    broadcast_plan(group, plan);
    if (plan.op != StepPlan::kStep) {
      lk.lock();
      return plan.op;
    }
    const StepResult result = runner.run(plan);
    lk.lock();
    ++metrics.steps;
    const std::vector<Drawn> drawn = scheduler.update(result);
    metrics.generation_tokens += static_cast<int64_t>(drawn.size());
    ds = outputs.process(drawn, metrics.ttft, metrics.itl);
    for (const auto& d : ds) metrics.finished += d.second.finished;
    metrics.kv_blocks_used = runner.blocks().used();
    metrics.prefix_cache_queries = runner.blocks().stats().queries;
    metrics.prefix_cache_hits = runner.blocks().stats().hits;
    metrics.context_parallel_prefills = model->context_parallel_prefills();
    lk.unlock();
    deliver(ds);
    lk.lock();
    return StepPlan::kStep;
  }

  // A step failed (a rank died, a collective failed): every open request
  // fails saying so, and the engine refuses new ones.
  void stepFailed(const std::exception& e) {
    const std::string why = "dtp::inference::Engine: a step failed, so the engine stops (a rank died or a collective "
                            "failed): " + messageOf(e);
    std::cerr << why << "\n";
    std::vector<Delivery> ds;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (dead.empty()) dead = why;
      failAllLocked(why, ds);
    }
    deliver(ds);
  }

  std::shared_ptr<Model> model;
  const EngineOptions options;
  const std::optional<ProcessGroup> group;
  const models::Tokenizer* tokenizer;
  ModelRunner runner;

  mutable std::mutex mu;  // guards what follows
  std::condition_variable cv;
  Scheduler scheduler;
  OutputProcessor outputs;
  std::map<int64_t, std::shared_ptr<SchedRequest>> open;  // by id, until finished
  std::vector<int64_t> cancelled_ids;
  std::deque<Output> polled;
  EngineMetrics metrics;
  int64_t next_id = 1;
  bool stopping = false;
  std::string dead;
};

Engine::Engine(std::shared_ptr<Model> model, const EngineOptions& options, std::optional<ProcessGroup> group,
               const models::Tokenizer* tokenizer) {
  TORCH_CHECK(model != nullptr, "dtp::inference::Engine: no model: got a null Model, expected one (e.g. "
              "models::engine_model(llama)).");
  impl_ = std::make_unique<Impl>(std::move(model), options, std::move(group), tokenizer);
}

Engine::~Engine() = default;

Ticket Engine::enqueue(std::vector<int64_t> prompt, RequestOptions o, OutputCallback on_output) {
  Impl& m = *impl_;
  TORCH_CHECK(m.leader(), "dtp::inference::Engine::enqueue on rank ", m.group->rank(), ": requests go to the "
              "leader (rank 0 of the engine's group); the other ranks call follow().");
  const int64_t n = static_cast<int64_t>(prompt.size()), vocab = m.model->vocab_size();
  TORCH_CHECK(n >= 1 && n < m.options.context, "dtp::inference::Engine::enqueue: the prompt: got ", n, " tokens, "
              "expected 1 to ", m.options.context - 1, " (fewer than the context of ", m.options.context, "). Shorten it.");
  for (int64_t t : prompt) {
    TORCH_CHECK(t >= 0 && t < vocab, "dtp::inference::Engine::enqueue: the prompt holds token ", t, ", expected ids in "
                "[0, ", vocab, ") (the model's vocabulary).");
  }
  TORCH_CHECK(o.max_tokens >= 1 && n + o.max_tokens <= m.options.context, "dtp::inference::Engine::enqueue: "
              "max_tokens: got ", o.max_tokens, " with a prompt of ", n, " tokens, expected 1 to ",
              m.options.context - n, " (the context is ", m.options.context, " tokens).");
  TORCH_CHECK(o.sampling.temperature >= 0.0 && o.sampling.top_k >= 0 && o.sampling.top_p > 0.0 &&
                  o.sampling.top_p <= 1.0,
              "dtp::inference::Engine::enqueue: sampling: got temperature ", o.sampling.temperature, ", top_k ",
              o.sampling.top_k, ", top_p ", o.sampling.top_p, ", expected temperature >= 0, top_k >= 0, top_p in (0, 1].");
  TORCH_CHECK(o.stop.empty() || m.tokenizer != nullptr, "dtp::inference::Engine::enqueue: stop strings need text: "
              "got ", o.stop.size(), " stop strings and an engine without a tokenizer. Pass the tokenizer to Engine, "
              "or stop on stop_tokens.");
  TORCH_CHECK(o.logprobs >= -1 && o.logprobs <= kMaxTopLogprobs, "dtp::inference::Engine::enqueue: logprobs: got ",
              o.logprobs, ", expected -1 (none) or 0 to ", kMaxTopLogprobs, " top tokens.");
  for (const auto& s : o.stop) {
    TORCH_CHECK(!s.empty(), "dtp::inference::Engine::enqueue: stop: got an empty string, expected non-empty stop strings.");
  }
  std::lock_guard<std::mutex> lk(m.mu);
  if (!m.dead.empty()) return Ticket{-1, Refusal::kDead, m.dead};
  if (m.stopping) return Ticket{-1, Refusal::kStopping, "dtp::inference::Engine is shutting down."};
  if (m.scheduler.waiting() >= m.options.max_queue) {
    ++m.metrics.rejected;
    return Ticket{-1, Refusal::kQueueFull, "dtp::inference::Engine: too many waiting requests (max_queue " +
                                               std::to_string(m.options.max_queue) + "). Retry later."};
  }
  auto r = std::make_shared<SchedRequest>();
  r->id = m.next_id++;
  r->prompt = std::move(prompt);
  r->sampling = SequenceSampling{o.sampling, o.seed};
  r->max_tokens = o.max_tokens;
  r->stop_tokens = o.stop_tokens;
  r->logprobs = o.logprobs;
  m.outputs.add(std::make_shared<OutputState>(r->id, o, n, std::move(on_output)));
  m.open[r->id] = r;
  m.scheduler.add(r);
  ++m.metrics.requests;
  m.metrics.prompt_tokens += n;
  m.cv.notify_all();
  return Ticket{r->id, Refusal::kNone, ""};
}

void Engine::cancel(int64_t id) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lk(m.mu);
  auto it = m.open.find(id);
  if (it == m.open.end() || !m.outputs.has(id)) return;
  if (!it->second->cancelled.exchange(true)) {
    ++m.metrics.cancelled;
    m.cancelled_ids.push_back(id);
  }
  m.cv.notify_all();
}

std::vector<Output> Engine::poll() {
  std::lock_guard<std::mutex> lk(impl_->mu);
  std::vector<Output> out(impl_->polled.begin(), impl_->polled.end());
  impl_->polled.clear();
  return out;
}

bool Engine::step() {
  Impl& m = *impl_;
  TORCH_CHECK(m.leader(), "dtp::inference::Engine::step on rank ", m.group->rank(), ": the leader (rank 0 of the "
              "engine's group) steps; the other ranks call follow().");
  std::unique_lock<std::mutex> lk(m.mu);
  TORCH_CHECK(m.dead.empty(), m.dead);
  StepPlan plan = m.scheduler.next_plan();
  if (plan.op == StepPlan::kIdle && m.cancelled_ids.empty()) return !m.scheduler.idle();
  try {
    m.stepOnce(lk, std::move(plan));  // an idle plan only ends cancelled requests
  } catch (const std::exception& e) {
    lk.unlock();
    m.stepFailed(e);
    throw;
  }
  m.forgetFinished();
  return !m.scheduler.idle();
}

int Engine::serve(const std::atomic<bool>& stop, double grace_s) {
  Impl& m = *impl_;
  TORCH_CHECK(m.leader(), "dtp::inference::Engine::serve on rank ", m.group->rank(), ": the leader serves; the other "
              "ranks call follow().");
  Clock::time_point deadline;
  std::unique_lock<std::mutex> lk(m.mu);
  while (true) {
    std::vector<Delivery> ds;
    if (stop && !m.stopping) {
      m.stopping = true;
      deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(grace_s));
      m.failWaitingLocked("dtp::inference::Engine is shutting down: the request was queued and not started.", ds);
    }
    if (m.stopping && Clock::now() >= deadline) {
      m.failRunningLocked("dtp::inference::Engine is shutting down: the request did not finish in the grace period.", ds);
    }
    if (!ds.empty()) {
      lk.unlock();
      m.deliver(ds);
      lk.lock();
    }
    if (!m.dead.empty()) return 1;  // fail_all: a watch saw a rank die
    StepPlan plan = m.scheduler.next_plan();
    if (plan.op == StepPlan::kIdle) {
      if (m.stopping) {
        plan.op = StepPlan::kShutdown;
      } else if (m.cancelled_ids.empty() &&
                 m.cv.wait_for(lk, std::chrono::milliseconds(500)) != std::cv_status::timeout) {
        continue;  // work arrived: plan again
      }
      // Nothing to run: an idle plan now and then, so that the followers
      // learn of a stop (and the leader of a dead rank) while no one asks.
    }
    try {
      if (m.stepOnce(lk, std::move(plan)) == StepPlan::kShutdown) return 0;
    } catch (const std::exception& e) {
      lk.unlock();
      m.stepFailed(e);
      return 1;
    }
    m.forgetFinished();
  }
}

int Engine::follow() {
  Impl& m = *impl_;
  TORCH_CHECK(!m.leader(), "dtp::inference::Engine::follow on the leader (rank 0 of the engine's group, or an engine "
              "without a group): it steps or serves; the other ranks follow.");
  try {
    while (true) {
      const StepPlan plan = broadcast_plan(m.group, StepPlan{});
      if (plan.op == StepPlan::kShutdown) return 0;
      if (plan.op == StepPlan::kStep) m.runner.run(plan);
    }
  } catch (const std::exception& e) {
    std::cerr << "dtp::inference::Engine: a step failed on rank " << m.group->rank()
              << " (the leader died or a collective failed): " << messageOf(e) << "\n";
    return 1;
  }
}

void Engine::fail_all(const std::string& why) {
  Impl& m = *impl_;
  std::vector<Delivery> ds;
  {
    std::lock_guard<std::mutex> lk(m.mu);
    if (!m.dead.empty()) return;
    m.dead = why;
    m.failAllLocked(why, ds);
    m.cv.notify_all();
  }
  m.deliver(ds);
}

std::string Engine::dead() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->dead;
}

EngineMetrics Engine::metrics() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  EngineMetrics out = impl_->metrics;
  out.waiting = impl_->scheduler.waiting();
  out.running = static_cast<int64_t>(impl_->scheduler.running().size());
  out.preemptions = impl_->scheduler.preemptions();
  return out;
}

const EngineOptions& Engine::options() const { return impl_->options; }
int64_t Engine::num_blocks() const { return impl_->runner.blocks().total(); }
int64_t Engine::local_blocks() const { return impl_->runner.local_blocks(); }
int64_t Engine::block_bytes() const { return impl_->runner.block_bytes(); }

}  // namespace dtp::inference
