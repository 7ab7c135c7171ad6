// Pipeline schedules as data (include/dtp/pp/schedule.h): the actions per
// rank against their closed forms, the simulated bubble against
// (p-1)/(m+p-1), and the errors for schedules that cannot run.
#include "dist.h"
#include "dtp/pp/schedule.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>

using dtp::pp::Action;
using dtp::pp::Schedule;
using dtp::test::expect_error;

namespace {

// The most microbatches whose activations a rank holds at once: forwards
// run minus backwards run, at its peak.
int peakInFlight(const std::vector<Action>& actions) {
  int live = 0, peak = 0;
  for (const Action& a : actions) peak = std::max(peak, live += a.kind == Action::Forward ? 1 : -1);
  return peak;
}

TEST(PipelineSchedule, GoldenActions) {
  EXPECT_EQ(Schedule::gpipe(2, 3).str(),
            "rank 0: 0F0 0F1 0F2 0B0 0B1 0B2\n"
            "rank 1: 1F0 1F1 1F2 1B0 1B1 1B2\n");
  EXPECT_EQ(Schedule::one_f_one_b(4, 4).str(),
            "rank 0: 0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3\n"
            "rank 1: 1F0 1F1 1F2 1B0 1F3 1B1 1B2 1B3\n"
            "rank 2: 2F0 2F1 2B0 2F2 2B1 2F3 2B2 2B3\n"
            "rank 3: 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3\n");
  // Stage s on rank s % 2: rank 0 holds stages 0 and 2.
  EXPECT_EQ(Schedule::interleaved_1f1b(2, 2, 2).str(),
            "rank 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1\n"
            "rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1\n");
}

// With unit forward and backward costs both GPipe and 1F1B idle each rank
// for p-1 forward and p-1 backward slots of 2(m+p-1): the bubble is
// (p-1)/(m+p-1). 1F1B keeps at most p-r microbatches in flight on rank r,
// GPipe all m.
TEST(PipelineSchedule, BubbleAndMemoryMatchTheClosedForm) {
  for (int p : {2, 4}) {
    for (int m : {4, 8, 9}) {
      const double closed = static_cast<double>(p - 1) / (m + p - 1);
      const Schedule gpipe = Schedule::gpipe(p, m), ofob = Schedule::one_f_one_b(p, m);
      EXPECT_NEAR(gpipe.simulate().bubble, closed, 1e-12) << "GPipe p=" << p << " m=" << m;
      EXPECT_NEAR(ofob.simulate().bubble, closed, 1e-12) << "1F1B p=" << p << " m=" << m;
      EXPECT_DOUBLE_EQ(ofob.simulate().time, 2.0 * (m + p - 1));
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(peakInFlight(gpipe.actions(r)), m);
        EXPECT_EQ(peakInFlight(ofob.actions(r)), p - r) << "1F1B p=" << p << " m=" << m << " rank " << r;
        EXPECT_EQ(ofob.actions(r).size(), 2u * m);
      }
    }
  }
  // Backward twice the forward (the usual ratio): 1F1B's time is
  // (m+p-1)(f+b) as well.
  EXPECT_DOUBLE_EQ(Schedule::one_f_one_b(4, 8).simulate(1.0, 2.0).time, 11 * 3.0);
}

// Interleaving v stages per rank cuts the bubble to (p-1)/(v*m+p-1) in
// units of one virtual stage.
TEST(PipelineSchedule, InterleavedCutsTheBubble) {
  for (int p : {2, 4}) {
    for (int v : {2, 3}) {
      for (int m : {p, 2 * p}) {
        const Schedule s = Schedule::interleaved_1f1b(p, v, m);
        EXPECT_EQ(s.stages(), p * v);
        const double bubble = s.simulate().bubble, closed = static_cast<double>(p - 1) / (v * m + p - 1);
        EXPECT_NEAR(bubble, closed, 1e-12) << "p=" << p << " v=" << v << " m=" << m;
        EXPECT_LT(bubble, Schedule::one_f_one_b(p, m).simulate().bubble);
      }
    }
  }
}

TEST(PipelineSchedule, SchedulesThatCannotRunAreNamedErrors) {
  expect_error([] { Schedule::one_f_one_b(4, 2); },
              "1F1B: 2 microbatches for 4 stages: 1F1B needs at least as many microbatches as stages");
  expect_error([] { Schedule::interleaved_1f1b(4, 2, 6); }, "Use a multiple of 4 microbatches");
  expect_error([] { Schedule::gpipe(0, 4); }, "Use at least one of each");
  using A = Action;
  auto custom = [](std::vector<std::vector<Action>> actions) { Schedule("custom", 2, 2, std::move(actions)); };
  const std::vector<Action> rank1{{A::Forward, 1, 0}, {A::Backward, 1, 0}, {A::Forward, 1, 1}, {A::Backward, 1, 1}};
  expect_error([&] { custom({{{A::Forward, 0, 0}, {A::Backward, 0, 0}, {A::Forward, 0, 1}}, rank1}); },
              "stage 0 never runs the backward of microbatch 1");
  expect_error([&] { custom({{{A::Forward, 0, 0}, {A::Forward, 0, 0}}, rank1}); }, "0F0 appears twice on rank 0");
  expect_error([&] { custom({{{A::Forward, 1, 0}}, rank1}); }, "action 1F0 is on rank 0, but stage 1 runs on rank 1");
  expect_error([&] { custom({{{A::Backward, 0, 0}, {A::Forward, 0, 0}, {A::Forward, 0, 1}, {A::Backward, 0, 1}}, rank1}); },
              "0B0 comes before 0F0");
  // Rank 0 waits for 1B0, which rank 1 runs after 1F1, which needs 0F1,
  // which rank 0 runs after 0B0.
  const Schedule deadlock("custom", 2, 2,
                          {{{A::Forward, 0, 0}, {A::Backward, 0, 0}, {A::Forward, 0, 1}, {A::Backward, 0, 1}},
                           {{A::Forward, 1, 0}, {A::Forward, 1, 1}, {A::Backward, 1, 0}, {A::Backward, 1, 1}}});
  expect_error([&] { deadlock.simulate(); }, "the ranks would deadlock: rank 0 at 0B0, rank 1 at 1F1");
  // NOTE: [Microbatch order]: it simulates (no deadlock), but stage 1 would
  // take microbatch 0's activation for microbatch 1, and so on.
  expect_error([&] { custom({{{A::Forward, 0, 0}, {A::Forward, 0, 1}, {A::Backward, 0, 0}, {A::Backward, 0, 1}},
                             {{A::Forward, 1, 1}, {A::Forward, 1, 0}, {A::Backward, 1, 1}, {A::Backward, 1, 0}}}); },
               "on rank 1, 1F1 runs before 1F0. Each stage runs its forwards, and its backwards, in microbatch order");
  expect_error([&] { custom({{{A::Forward, 0, 0}, {A::Forward, 0, 1}, {A::Backward, 0, 1}, {A::Backward, 0, 0}},
                             rank1}); },
               "on rank 0, 0B1 runs before 0B0");
}

}  // namespace
