#include "scheduler.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>

namespace dtp::inference {

// See NOTE: [Serving step]. The runner's state between steps is read here
// (the leader's runner), and the plan says what every rank's runner does
// with it.
StepPlan Scheduler::next_plan() {
  const EngineOptions& o = runner_.options();
  const std::vector<ModelRunner::Row>& rows = runner_.rows();
  TORCH_INTERNAL_ASSERT(rows.size() == running_.size());
  StepPlan plan;
  // 1. Rows that go on; the blocks of the others come back. With prefix
  // caching a block may have several holders: it comes back to free() when
  // its last holder leaves, and a cached one no one holds leaves free()
  // when a request holds it again. `held` is each touched block's holders
  // after this plan.
  const BlockPool& pool = runner_.blocks();
  std::map<int64_t, int64_t> held;
  int64_t free = pool.free();
  auto holders = [&](int64_t b) -> int64_t& {
    auto it = held.find(b);
    return it != held.end() ? it->second : held.emplace(b, pool.refcount(b)).first->second;
  };
  auto release = [&](const std::vector<int64_t>& blocks) {
    for (int64_t b : blocks) free += --holders(b) == 0;
  };
  std::vector<size_t> kept;
  for (size_t i = 0; i < running_.size(); ++i) {
    SchedRequest& r = *running_[i];
    if (r.finished || r.cancelled) {
      r.finished = true;
      release(rows[i].blocks);
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
    release(rows[i].blocks);
    need -= needs(i);
    preempted.push_back(i);
  }
  free -= need;
  for (size_t i : preempted) {
    ++running_[i]->preemptions;
    ++preemptions_;
    waiting_.push_front(running_[i]);  // the oldest preempted ends in front
    plan.preempt.insert(plan.preempt.begin(), static_cast<int64_t>(i));
  }
  std::vector<std::shared_ptr<SchedRequest>> next;
  int64_t budget = o.prefill_chunk, prefilling = 0;
  for (size_t i : kept) {
    plan.keep.push_back(static_cast<int64_t>(i));
    next.push_back(running_[i]);
    if (rows[i].decoding()) {
      plan.tokens.push_back(running_[i]->generated.back());
      continue;
    }
    // 3. Prompt chunks, oldest first, within prefill_chunk tokens.
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
    std::shared_ptr<SchedRequest> r = waiting_.front();
    if (r->cancelled || r->finished) {
      waiting_.pop_front();
      r->finished = true;
      if (r->preemptions > 0) plan.forget.push_back(r->id);  // its generator, kept by every rank
      continue;
    }
    Admission a{r->id, r->sampling, r->prompt, r->preemptions > 0, r->logprobs, 0};
    a.prompt.insert(a.prompt.end(), r->generated.begin(), r->generated.end());
    // Its cached prefix costs no fresh block, but a cached block no one
    // holds leaves free() once held (NOTE: [Prefix cache] in block_pool.h).
    const std::vector<int64_t> hits = pool.match(a.prompt);
    int64_t blocks = runner_.blocks_for(static_cast<int64_t>(a.prompt.size())) - static_cast<int64_t>(hits.size());
    for (int64_t b : hits) blocks += holders(b) == 0;
    if (blocks > free) break;
    free -= blocks;
    for (int64_t b : hits) ++holders(b);
    waiting_.pop_front();
    a.cached = static_cast<int64_t>(hits.size()) * pool.block_size();
    const int64_t chunk = std::min(static_cast<int64_t>(a.prompt.size()) - a.cached, budget);
    plan.chunks.push_back(chunk);
    budget -= chunk;
    ++prefilling;
    plan.admit.push_back(std::move(a));
    next.push_back(r);
  }
  const bool changed = next.size() != running_.size() || !plan.admit.empty() || plan.keep.size() != running_.size() ||
                       !plan.forget.empty();
  running_ = std::move(next);
  plan.op = !running_.empty() || changed ? StepPlan::kStep : StepPlan::kIdle;
  return plan;
}

std::vector<Drawn> Scheduler::update(const StepResult& result) {
  TORCH_INTERNAL_ASSERT(result.tokens.size() == running_.size());
  std::vector<Drawn> drawn;
  for (size_t i = 0; i < running_.size(); ++i) {
    if (result.tokens[i] < 0) continue;
    SchedRequest& r = *running_[i];
    if (r.finished) continue;  // failed during the step (a shutdown's grace ran out)
    const int64_t token = result.tokens[i];
    r.generated.push_back(token);
    Drawn d{running_[i], token, result.logprobs[i], std::nullopt};
    if (std::find(r.stop_tokens.begin(), r.stop_tokens.end(), token) != r.stop_tokens.end()) {
      d.finish = FinishReason::kStop;
    } else if (static_cast<int64_t>(r.generated.size()) >= r.max_tokens) {
      d.finish = FinishReason::kLength;
    }
    if (d.finish) r.finished = true;
    drawn.push_back(std::move(d));
  }
  return drawn;
}

std::vector<std::shared_ptr<SchedRequest>> Scheduler::drain_waiting() {
  std::vector<std::shared_ptr<SchedRequest>> out(waiting_.begin(), waiting_.end());
  waiting_.clear();
  return out;
}

}  // namespace dtp::inference
