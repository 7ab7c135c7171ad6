#include "dtp/pp/schedule.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <map>
#include <utility>

namespace dtp::pp {

std::string Action::str() const { return c10::str(stage, kind == Forward ? "F" : "B", microbatch); }

namespace {

void checkSizes(const char* name, int stages, int microbatches) {
  TORCH_CHECK(stages >= 1 && microbatches >= 1, "Schedule ", name, ": ", stages, " stages and ", microbatches,
              " microbatches. Use at least one of each.");
}

}  // namespace

int Schedule::rank_of(int stage) const {
  TORCH_CHECK(stage >= 0 && stage < stages_, "Schedule::rank_of: stage ", stage, " is not one of the ", name_,
              " schedule's ", stages_, " stages. Give 0 <= stage < ", stages_, ".");
  return stage % ranks();
}

const std::vector<Action>& Schedule::actions(int rank) const {
  TORCH_CHECK(rank >= 0 && rank < ranks(), "Schedule::actions: rank ", rank, " is not one of the ", name_,
              " schedule's ", ranks(), " ranks. Give 0 <= rank < ", ranks(), ".");
  return per_rank_[rank];
}

Schedule::Schedule(std::string name, int stages, int microbatches, std::vector<std::vector<Action>> per_rank)
    : name_(std::move(name)), stages_(stages), microbatches_(microbatches), per_rank_(std::move(per_rank)) {
  checkSizes(name_.c_str(), stages, microbatches);
  const int p = ranks();
  TORCH_CHECK(p >= 1 && stages % p == 0, "Schedule ", name_, ": ", stages, " stages on ", p,
              " ranks. Give each rank the same number of stages (stage s runs on rank s % ranks).");
  // Each (stage, microbatch) forward and backward exactly once, on the
  // stage's rank, the forward first.
  std::map<std::pair<int, int>, int> forward_at, backward_at;
  for (int r = 0; r < p; ++r) {
    for (int i = 0; i < static_cast<int>(per_rank_[r].size()); ++i) {
      const Action& a = per_rank_[r][i];
      TORCH_CHECK(a.stage >= 0 && a.stage < stages && a.microbatch >= 0 && a.microbatch < microbatches,
                  "Schedule ", name_, ": action ", a.str(), " on rank ", r, " names a stage or microbatch outside ",
                  stages, " stages and ", microbatches, " microbatches.");
      TORCH_CHECK(rank_of(a.stage) == r, "Schedule ", name_, ": action ", a.str(), " is on rank ", r,
                  ", but stage ", a.stage, " runs on rank ", rank_of(a.stage), " (stage s on rank s % ", p, ").");
      auto& seen = a.kind == Action::Forward ? forward_at : backward_at;
      TORCH_CHECK(seen.emplace(std::make_pair(a.stage, a.microbatch), i).second, "Schedule ", name_, ": action ",
                  a.str(), " appears twice on rank ", r, ". Run each forward and backward once.");
    }
  }
  for (int s = 0; s < stages; ++s) {
    for (int mb = 0; mb < microbatches; ++mb) {
      const auto f = forward_at.find({s, mb}), b = backward_at.find({s, mb});
      TORCH_CHECK(f != forward_at.end() && b != backward_at.end(), "Schedule ", name_, ": stage ", s,
                  " never runs the ", f == forward_at.end() ? "forward" : "backward", " of microbatch ", mb,
                  ". Every stage runs every microbatch's forward and backward.");
      TORCH_CHECK(f->second < b->second, "Schedule ", name_, ": on rank ", rank_of(s), ", ",
                  Action{Action::Backward, s, mb}.str(), " comes before ", Action{Action::Forward, s, mb}.str(),
                  ". A backward needs its forward first.");
    }
  }
  // NOTE: [Microbatch order] Messages between two stages are matched in the
  // order they were sent (one tag per boundary and direction), so each
  // stage runs its forwards, and its backwards, in microbatch order: 1F0
  // before 1F1. A stage that ran 1F1 first would take microbatch 0's
  // activation as microbatch 1's (wrong gradients, silently).
  for (int r = 0; r < p; ++r) {
    std::map<std::pair<int, int>, int> next;  // (stage, kind) -> the microbatch due next
    for (const Action& a : per_rank_[r]) {
      int& due = next[{a.stage, static_cast<int>(a.kind)}];
      TORCH_CHECK(a.microbatch == due, "Schedule ", name_, ": on rank ", r, ", ", a.str(), " runs before ",
                  Action{a.kind, a.stage, due}.str(), ". Each stage runs its forwards, and its backwards, in "
                  "microbatch order (messages between stages are matched in order); reorder the actions.");
      ++due;
    }
  }
}

Schedule Schedule::gpipe(int stages, int microbatches) {
  checkSizes("GPipe", stages, microbatches);
  std::vector<std::vector<Action>> per_rank(stages);
  for (int s = 0; s < stages; ++s) {
    for (int mb = 0; mb < microbatches; ++mb) per_rank[s].push_back({Action::Forward, s, mb});
    for (int mb = 0; mb < microbatches; ++mb) per_rank[s].push_back({Action::Backward, s, mb});
  }
  return Schedule("GPipe", stages, microbatches, std::move(per_rank));
}

Schedule Schedule::one_f_one_b(int stages, int microbatches) {
  checkSizes("1F1B", stages, microbatches);
  TORCH_CHECK(microbatches >= stages, "Schedule 1F1B: ", microbatches, " microbatches for ", stages,
              " stages: 1F1B needs at least as many microbatches as stages to fill the pipeline. Use ",
              stages, " or more microbatches, or GPipe.");
  std::vector<std::vector<Action>> per_rank(stages);
  for (int r = 0; r < stages; ++r) {
    auto& a = per_rank[r];
    const int warmup = std::min(stages - 1 - r, microbatches);
    int f = 0, b = 0;
    for (; f < warmup; ++f) a.push_back({Action::Forward, r, f});
    for (; f < microbatches; ++f, ++b) {
      a.push_back({Action::Forward, r, f});
      a.push_back({Action::Backward, r, b});
    }
    for (; b < microbatches; ++b) a.push_back({Action::Backward, r, b});
  }
  return Schedule("1F1B", stages, microbatches, std::move(per_rank));
}

Schedule Schedule::interleaved_1f1b(int ranks, int stages_per_rank, int microbatches) {
  checkSizes("Interleaved1F1B", ranks * stages_per_rank, microbatches);
  TORCH_CHECK(microbatches % ranks == 0, "Schedule Interleaved1F1B: ", microbatches,
              " microbatches on ", ranks, " ranks: the interleaved schedule moves microbatches through the "
              "virtual stages in groups of one per rank. Use a multiple of ", ranks, " microbatches.");
  const int p = ranks, v = stages_per_rank, total = microbatches * v;
  std::vector<std::vector<Action>> per_rank(p);
  for (int r = 0; r < p; ++r) {
    // The k-th forward (backward) of this rank: microbatches in groups of
    // p, each group through the rank's stages in order (reversed backward).
    auto nth = [&](Action::Kind kind, int k) {
      const int chunk = (k / p) % v;
      const int mb = (k / (p * v)) * p + k % p;
      return Action{kind, (kind == Action::Forward ? chunk : v - 1 - chunk) * p + r, mb};
    };
    auto& a = per_rank[r];
    const int warmup = std::min((p - r - 1) * 2 + (v - 1) * p, total);
    int f = 0, b = 0;
    for (; f < warmup; ++f) a.push_back(nth(Action::Forward, f));
    for (; f < total; ++f, ++b) {
      a.push_back(nth(Action::Forward, f));
      a.push_back(nth(Action::Backward, b));
    }
    for (; b < total; ++b) a.push_back(nth(Action::Backward, b));
  }
  return Schedule("Interleaved1F1B", p * v, microbatches, std::move(per_rank));
}

std::string Schedule::str() const {
  std::string s;
  for (int r = 0; r < ranks(); ++r) {
    s += c10::str("rank ", r, ":");
    for (const Action& a : per_rank_[r]) s += " " + a.str();
    s += "\n";
  }
  return s;
}

// Each rank runs its actions in order, each as soon as the rank is free and
// its inputs exist: F(s, mb) after F(s-1, mb); B(s, mb) after F(s, mb) and
// B(s+1, mb) (the last stage's backward starts from its own forward's loss).
Simulation Schedule::simulate(double forward, double backward) const {
  const int p = ranks();
  std::map<std::pair<int, int>, double> forward_end, backward_end;
  std::vector<size_t> next(p, 0);
  std::vector<double> free_at(p, 0.0);
  Simulation sim;
  sim.start.resize(p);
  double busy = 0;
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (int r = 0; r < p; ++r) {
      while (next[r] < per_rank_[r].size()) {
        const Action& a = per_rank_[r][next[r]];
        double ready = free_at[r];
        auto need = [&](const std::map<std::pair<int, int>, double>& done, int stage) {
          const auto it = done.find({stage, a.microbatch});
          if (it == done.end()) return false;
          ready = std::max(ready, it->second);
          return true;
        };
        const bool runnable = a.kind == Action::Forward
                                  ? a.stage == 0 || need(forward_end, a.stage - 1)
                                  : need(forward_end, a.stage) && (a.stage == stages_ - 1 || need(backward_end, a.stage + 1));
        if (!runnable) break;
        const double cost = a.kind == Action::Forward ? forward : backward;
        sim.start[r].push_back(ready);
        free_at[r] = ready + cost;
        busy += cost;
        (a.kind == Action::Forward ? forward_end : backward_end)[{a.stage, a.microbatch}] = free_at[r];
        ++next[r];
        progressed = true;
      }
    }
  }
  std::string stuck;
  for (int r = 0; r < p; ++r)
    if (next[r] < per_rank_[r].size()) stuck += c10::str(stuck.empty() ? "" : ", ", "rank ", r, " at ", per_rank_[r][next[r]].str());
  TORCH_CHECK(stuck.empty(), "Schedule ", name_, ": the ranks would deadlock: ", stuck,
              " each wait for an action that a rank runs only later. Reorder the actions.");
  sim.time = *std::max_element(free_at.begin(), free_at.end());
  sim.bubble = sim.time > 0 ? 1.0 - busy / (p * sim.time) : 0.0;
  return sim;
}

}  // namespace dtp::pp
