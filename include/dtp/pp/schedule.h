// Pipeline schedules as data: per pp rank, the ordered list of what it runs,
// (stage, microbatch, forward or backward), as torch.distributed.pipelining's
// schedules print them ("1F0": stage 1 forward of microbatch 0). A schedule
// is checked when built (every stage runs every microbatch's forward, then
// its backward, once, each in microbatch order; a rank runs only its own
// stages) and can be simulated:
// simulate() runs the actions with unit costs under the pipeline's
// dependencies and reports the time and the idle share (the bubble), or
// names the action where the ranks would deadlock.
//
//   auto s = dtp::pp::Schedule::one_f_one_b(/*stages=*/4, /*microbatches=*/8);
//   std::cout << s.str();                      // rank 0: 0F0 0F1 0F2 0F3 0B0 0F4 ...
//   s.simulate().bubble                       // (p-1)/(m+p-1) = 3/11 here
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtp::pp {

struct Action {
  enum Kind : uint8_t { Forward, Backward };
  Kind kind;
  int stage;
  int microbatch;
  std::string str() const;  // "1F0", "3B7"
  bool operator==(const Action& o) const {
    return kind == o.kind && stage == o.stage && microbatch == o.microbatch;
  }
};

struct Simulation {
  double time = 0;    // until the last action ends
  double bubble = 0;  // the ranks' idle time over ranks x time
  std::vector<std::vector<double>> start;  // per rank, per action: when it starts
};

class Schedule {
 public:
  // GPipe: every rank runs all its forwards, then all its backwards.
  static Schedule gpipe(int stages, int microbatches);
  // 1F1B (PipeDream-flush): rank r runs min(p-1-r, m) forwards, then
  // alternates one forward and one backward, then the remaining backwards;
  // at most p-r microbatches' activations live at once. Needs m >= p.
  static Schedule one_f_one_b(int stages, int microbatches);
  // Interleaved 1F1B (Megatron's virtual stages): `ranks` ranks hold
  // ranks*stages_per_rank stages, stage s on rank s % ranks. Needs
  // microbatches to be a multiple of ranks.
  static Schedule interleaved_1f1b(int ranks, int stages_per_rank, int microbatches);
  // A schedule from its actions, checked as the built-in ones are. Stage s
  // runs on rank s % ranks.
  Schedule(std::string name, int stages, int microbatches, std::vector<std::vector<Action>> per_rank);

  const std::string& name() const { return name_; }
  int ranks() const { return static_cast<int>(per_rank_.size()); }
  int stages() const { return stages_; }
  int microbatches() const { return microbatches_; }
  // The rank of stage `stage` (0 <= stage < stages()).
  int rank_of(int stage) const;
  // Rank `rank`'s actions in order (0 <= rank < ranks()).
  const std::vector<Action>& actions(int rank) const;
  // One line per rank: "rank 0: 0F0 0F1 0B0 ...".
  std::string str() const;
  // Forward costs `forward`, backward `backward`; messages are free.
  Simulation simulate(double forward = 1.0, double backward = 1.0) const;

 private:
  std::string name_;
  int stages_, microbatches_;
  std::vector<std::vector<Action>> per_rank_;
};

}  // namespace dtp::pp
