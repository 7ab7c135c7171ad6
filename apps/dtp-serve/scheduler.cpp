#include "scheduler.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <iostream>

namespace dtp::serve {
namespace {

std::string messageOf(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

}  // namespace

Scheduler::Scheduler(Engine& engine, const models::Tokenizer& tokenizer, std::optional<ProcessGroup> group,
                     int64_t max_queue, double shutdown_grace_s)
    : engine_(engine), tokenizer_(tokenizer), group_(std::move(group)), max_queue_(max_queue), grace_s_(shutdown_grace_s) {
  metrics_.kv_blocks_total = engine.blocks().total();
  metrics_.kv_block_size = engine.options().block_size;
}

Scheduler::Submit Scheduler::submit(const std::shared_ptr<Request>& r) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!dead_.empty()) return Submit::kDead;
  if (stopping_) return Submit::kStopping;
  if (static_cast<int64_t>(waiting_.size()) >= max_queue_) {
    ++metrics_.rejected;
    return Submit::kQueueFull;
  }
  waiting_.push_back(r);
  ++metrics_.requests;
  metrics_.prompt_tokens += static_cast<int64_t>(r->prompt.size());
  cv_.notify_one();
  return Submit::kQueued;
}

Metrics Scheduler::metrics() const {
  std::lock_guard<std::mutex> lk(mu_);
  Metrics m = metrics_;
  m.waiting = static_cast<int64_t>(waiting_.size());
  m.running = static_cast<int64_t>(running_.size());
  return m;
}

std::string Scheduler::dead() const {
  std::lock_guard<std::mutex> lk(mu_);
  return dead_;
}

void Scheduler::rank_died(const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!dead_.empty()) return;
  dead_ = why;
  for (auto& r : running_) fail(*r, 503, why);
  for (auto& r : waiting_) fail(*r, 503, why);
}

void Scheduler::fail(Request& r, int status, const std::string& message) {
  std::lock_guard<std::mutex> lk(r.m);
  if (r.done) return;
  r.done = true;
  r.error_status = status;
  r.error_message = message;
  ++metrics_.failed;
  r.cv.notify_all();
}

// See NOTE: [Serving step]. The engine's state between steps is read here
// (rank 0's engine, on this thread), and the plan says what every rank's
// engine does with it.
StepPlan Scheduler::nextPlan(const std::atomic<bool>& stop) {
  std::unique_lock<std::mutex> lk(mu_);
  const EngineOptions& o = engine_.options();
  while (true) {
    if (stop && !stopping_) {
      stopping_ = true;
      stop_deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(grace_s_));
      for (auto& r : waiting_) fail(*r, 503, "dtp-serve is shutting down: the request was queued and not started.");
      waiting_.clear();
    }
    if (stopping_ && Clock::now() >= stop_deadline_) {
      for (auto& r : running_) fail(*r, 503, "dtp-serve is shutting down: the request did not finish in the grace period.");
    }
    const std::vector<Engine::Row>& rows = engine_.rows();
    TORCH_INTERNAL_ASSERT(rows.size() == running_.size());
    StepPlan plan;
    // 1. Rows that go on; the blocks of the others come back.
    std::vector<size_t> kept;
    int64_t free = engine_.blocks().free();
    for (size_t i = 0; i < running_.size(); ++i) {
      Request& r = *running_[i];
      bool done;
      {
        std::lock_guard<std::mutex> rl(r.m);
        done = r.done;
      }
      if (r.cancelled && !done) ++metrics_.cancelled;
      if (done || r.cancelled) {
        free += static_cast<int64_t>(rows[i].blocks.size());
        continue;
      }
      kept.push_back(i);
    }
    // 2. A decoding row whose blocks are full takes one more; while more are
    // needed than are free, the newest row is preempted (requeued in front,
    // to be recomputed from its prompt and tokens so far).
    auto needs = [&](size_t i) {
      return rows[i].decoding() && rows[i].cached + 1 > static_cast<int64_t>(rows[i].blocks.size()) * o.block_size ? 1 : 0;
    };
    int64_t need = 0;
    for (size_t i : kept) need += needs(i);
    std::vector<size_t> preempted;  // newest first
    while (need > free) {
      const size_t i = kept.back();
      kept.pop_back();
      free += static_cast<int64_t>(rows[i].blocks.size());
      need -= needs(i);
      preempted.push_back(i);
    }
    free -= need;
    for (size_t i : preempted) {
      ++running_[i]->preemptions;
      ++metrics_.preemptions;
      waiting_.push_front(running_[i]);  // the oldest preempted ends in front
      plan.preempt.insert(plan.preempt.begin(), static_cast<int64_t>(i));
    }
    std::vector<std::shared_ptr<Request>> next;
    int64_t budget = o.prefill_chunk, prefilling = 0;
    for (size_t i : kept) {
      plan.keep.push_back(static_cast<int64_t>(i));
      next.push_back(running_[i]);
      if (rows[i].decoding()) {
        std::lock_guard<std::mutex> rl(running_[i]->m);
        plan.tokens.push_back(running_[i]->generated.back());
        continue;
      }
      // 3. Prompt chunks, oldest first, within --prefill-chunk tokens.
      const int64_t left = static_cast<int64_t>(rows[i].prompt.size()) - rows[i].cached;
      const int64_t chunk = prefilling < o.max_prefill ? std::min(left, budget) : 0;
      plan.chunks.push_back(chunk);
      budget -= chunk;
      prefilling += chunk > 0;
    }
    // 4. Admissions, first come first served, while the blocks of the whole
    // prompt are free (a resumed request: prompt and tokens so far).
    while (!waiting_.empty() && static_cast<int64_t>(next.size()) < o.max_batch && budget > 0 &&
           prefilling < o.max_prefill) {
      std::shared_ptr<Request> r = waiting_.front();
      if (r->cancelled) {
        waiting_.pop_front();
        ++metrics_.cancelled;
        if (r->preemptions > 0) plan.forget.push_back(r->id);  // its generator, kept by every rank
        continue;
      }
      Admission a{r->id, r->sampling, r->prompt, r->preemptions > 0};
      {
        std::lock_guard<std::mutex> rl(r->m);
        a.prompt.insert(a.prompt.end(), r->generated.begin(), r->generated.end());
      }
      const int64_t blocks = engine_.blocks_for(static_cast<int64_t>(a.prompt.size()));
      if (blocks > free) break;
      free -= blocks;
      waiting_.pop_front();
      const int64_t chunk = std::min(static_cast<int64_t>(a.prompt.size()), budget);
      plan.chunks.push_back(chunk);
      budget -= chunk;
      ++prefilling;
      plan.admit.push_back(std::move(a));
      next.push_back(r);
    }
    const bool changed = next.size() != running_.size() || !plan.admit.empty() || plan.keep.size() != running_.size() ||
                         !plan.forget.empty();
    running_ = std::move(next);
    if (!running_.empty() || changed) {
      plan.op = StepPlan::kStep;
      return plan;
    }
    if (stopping_) {
      plan.op = StepPlan::kShutdown;
      return plan;
    }
    // Nothing to run: an idle plan now and then, so that the other ranks
    // learn of a stop (and rank 0 of a dead rank) while no one asks.
    if (cv_.wait_for(lk, std::chrono::milliseconds(500)) == std::cv_status::timeout) {
      plan.op = StepPlan::kIdle;
      return plan;
    }
  }
}

void Scheduler::pushToken(Request& r, int64_t token) {
  const bool stop_token = std::find(r.stop_tokens.begin(), r.stop_tokens.end(), token) != r.stop_tokens.end();
  if (!stop_token) {
    // Ids past the tokenizer's vocabulary (a model's padded vocabulary) add
    // no text, as in dtp-generate.
    if (token < tokenizer_.vocab_size()) r.text_ids.push_back(token);
    r.text.update(tokenizer_.decode(r.text_ids, /*skip_special_tokens=*/true));
  }
  std::lock_guard<std::mutex> lk(r.m);
  r.generated.push_back(token);
  const Clock::time_point now = Clock::now();
  if (!r.first_token) {
    r.first_token = now;
    metrics_.ttft.observe(std::chrono::duration<double>(now - r.arrived).count());
  } else {
    metrics_.itl.observe(std::chrono::duration<double>(now - r.last_token).count());
  }
  r.last_token = now;
  ++metrics_.generation_tokens;
  std::string reason;
  if (stop_token || r.text.stopped()) {
    reason = "stop";
  } else if (static_cast<int64_t>(r.generated.size()) >= r.max_tokens) {
    reason = "length";
  }
  if (!reason.empty()) r.text.finish();
  r.pending += r.text.take();
  if (!reason.empty()) {
    r.done = true;
    r.finish_reason = reason;
    r.final_text = r.text.text();
    ++metrics_.finished;
  }
  r.cv.notify_all();
}

void Scheduler::apply(const StepResult& result) {
  std::lock_guard<std::mutex> lk(mu_);
  ++metrics_.steps;
  TORCH_INTERNAL_ASSERT(result.tokens.size() == running_.size());
  for (size_t i = 0; i < running_.size(); ++i) {
    if (result.tokens[i] >= 0) pushToken(*running_[i], result.tokens[i]);
  }
  metrics_.kv_blocks_used = engine_.blocks().used();
}

int Scheduler::serve(const std::atomic<bool>& stop) {
  while (true) {
    const StepPlan plan = nextPlan(stop);
    try {
      broadcast_plan(group_, plan);
      if (plan.op == StepPlan::kShutdown) return 0;
      if (plan.op == StepPlan::kIdle) continue;
      const StepResult result = engine_.run(plan);
      apply(result);
    } catch (const std::exception& e) {
      const std::string why = "dtp-serve: a step failed, so the server stops (a rank died or a collective failed): " +
                              messageOf(e);
      std::cerr << why << "\n";
      std::lock_guard<std::mutex> lk(mu_);
      if (dead_.empty()) dead_ = why;
      for (auto& r : running_) fail(*r, 503, why);
      for (auto& r : waiting_) fail(*r, 503, why);
      running_.clear();
      waiting_.clear();
      return 1;
    }
  }
}

int follow_plans(Engine& engine, const std::optional<ProcessGroup>& group) {
  try {
    while (true) {
      const StepPlan plan = broadcast_plan(group, StepPlan{});
      if (plan.op == StepPlan::kShutdown) return 0;
      if (plan.op == StepPlan::kStep) engine.run(plan);
    }
  } catch (const std::exception& e) {
    std::cerr << "dtp-serve: a step failed on this rank (rank 0 died or a collective failed): " << messageOf(e) << "\n";
    return 1;
  }
}

}  // namespace dtp::serve
