#include "supervisor.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <optional>
#include <poll.h>
#include <string>
#include <sys/wait.h>
#include <system_error>
#include <unistd.h>
#include <vector>

#include "io.h"
#include "line_prefixer.h"
#include "rank_env.h"
#include "signal_pipe.h"
#include "spawn.h"

namespace dtprun {

namespace {

using Clock = std::chrono::steady_clock;

// SIGTERM first lets ranks flush logs and close sockets; whatever is left
// after the grace period gets SIGKILL, so a job is gone within ~3 s.
constexpr auto kGracePeriod = std::chrono::seconds(3);

// Once every rank has exited and its process group is killed, its pipes close
// at once. Only a process that left the group (e.g. via setsid) can hold them
// open; we stop waiting for its output after this long.
constexpr auto kDrainPeriod = std::chrono::seconds(1);

// One of a rank's output pipes; fd is -1 once closed.
struct RankOutput {
  int fd;
  LinePrefixer prefixer;
};

struct Rank {
  int rank; // global
  pid_t pid; // also its process group id
  bool running;
  RankOutput out;
  RankOutput err;
};

std::string signalName(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev != nullptr ? std::string("SIG") + abbrev : "unknown";
}

std::string describeExit(int status) {
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + signalName(sig) + ")";
  }
  return "exited with status " + std::to_string(WEXITSTATUS(status));
}

// Shell convention: a process killed by signal S reports 128+S.
int exitCodeOf(int status) {
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

// Signals the rank's whole process group, so its children get it too. If the
// rank moved itself to another group, the old group may be empty; then at
// least the rank itself is signalled.
void signalRank(const Rank& rank, int sig) {
  if (::killpg(rank.pid, sig) != 0) {
    ::kill(rank.pid, sig);
  }
}

class Job {
 public:
  explicit Job(const LaunchOptions& options) : options_(options) {}

  int run() {
    start();
    supervise();
    return exit_code_;
  }
  bool interrupted() const { return interrupted_; }

 private:
  void start();
  void supervise();
  void reapExited();
  void onRankExit(Rank& rank, int status);
  void onSignal(int sig);
  void stop(int sig, int exit_code);
  void signalRunning(int sig);
  void readOutput(RankOutput& output);
  void drainAvailable(RankOutput& output);
  void closeOutput(RankOutput& output);
  bool anyRunning() const;
  bool anyOutputOpen() const;
  int pollTimeoutMs(Clock::time_point now) const;

  const LaunchOptions& options_;
  SignalPipe signals_;
  std::vector<Rank> ranks_;
  int exit_code_ = 0;
  bool stopping_ = false; // set once, by the first failure or signal
  bool interrupted_ = false; // dtprun received SIGINT, SIGTERM or SIGHUP
  std::optional<Clock::time_point> kill_deadline_;
  std::optional<Clock::time_point> drain_deadline_;
};

void Job::start() {
  ranks_.reserve(static_cast<size_t>(options_.nproc_per_node));
  for (int local_rank = 0; local_rank < options_.nproc_per_node; ++local_rank) {
    SpawnResult spawned = spawn_rank(options_.command, rank_environment(options_, local_rank));
    if (!spawned.error.empty()) {
      say(spawned.error);
      stop(SIGKILL, 127);
      return;
    }
    int rank = global_rank(options_, local_rank);
    std::string prefix = "[rank " + std::to_string(rank) + "] ";
    const RankProcess& p = spawned.process;
    ranks_.push_back(Rank{rank, p.pid, true, RankOutput{p.out_fd, LinePrefixer(prefix, STDOUT_FILENO)},
                          RankOutput{p.err_fd, LinePrefixer(prefix, STDERR_FILENO)}});
  }
}

void Job::supervise() {
  for (;;) {
    reapExited();
    Clock::time_point now = Clock::now();
    if (kill_deadline_ && now >= *kill_deadline_) {
      signalRunning(SIGKILL);
      kill_deadline_.reset();
    }
    if (!anyRunning()) {
      if (!drain_deadline_) {
        drain_deadline_ = now + kDrainPeriod;
      }
      if (!anyOutputOpen() || now >= *drain_deadline_) {
        break;
      }
    }

    std::vector<pollfd> fds{{signals_.fd(), POLLIN, 0}};
    std::vector<RankOutput*> outputs;
    for (Rank& rank : ranks_) {
      for (RankOutput* output : {&rank.out, &rank.err}) {
        if (output->fd >= 0) {
          fds.push_back({output->fd, POLLIN, 0});
          outputs.push_back(output);
        }
      }
    }
    if (::poll(fds.data(), fds.size(), pollTimeoutMs(now)) < 0) {
      if (errno == EINTR) {
        continue; // the signal is also on the pipe
      }
      throw std::system_error(errno, std::generic_category(), "poll");
    }
    if (fds[0].revents != 0) {
      for (int sig : signals_.drain()) {
        onSignal(sig);
      }
    }
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (fds[i + 1].revents != 0) {
        readOutput(*outputs[i]);
      }
    }
  }
  for (Rank& rank : ranks_) {
    closeOutput(rank.out);
    closeOutput(rank.err);
  }
}

void Job::reapExited() {
  for (;;) {
    siginfo_t info{};
    // WNOWAIT leaves the rank a zombie for now: a zombie keeps its pid, and
    // so its process group id, from being reused, so killing the group
    // before reaping the rank cannot hit an unrelated process.
    if (::waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) != 0) {
      if (errno == EINTR) {
        continue;
      }
      return; // ECHILD: no children left
    }
    if (info.si_pid == 0) {
      return; // children left, none exited
    }
    pid_t pid = info.si_pid;
    // Whatever the rank left running in its group would be an orphan.
    ::killpg(pid, SIGKILL);
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    for (Rank& rank : ranks_) {
      if (rank.pid == pid) {
        onRankExit(rank, status);
      }
    }
  }
}

void Job::onRankExit(Rank& rank, int status) {
  rank.running = false;
  bool succeeded = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (succeeded || stopping_) {
    return; // during a stop, exits are the ones we caused
  }
  // Its last words (often the error itself) are in the pipes already; print
  // them before the summary, not after it.
  drainAvailable(rank.out);
  drainAvailable(rank.err);
  std::string message =
      "rank " + std::to_string(rank.rank) + " (pid " + std::to_string(rank.pid) + ") " + describeExit(status);
  if (anyRunning()) {
    message += "; stopping the other ranks";
  }
  say(message);
  stop(SIGTERM, exitCodeOf(status));
}

void Job::onSignal(int sig) {
  if (sig == SIGCHLD) {
    return; // reapExited() runs every round
  }
  interrupted_ = true;
  if (stopping_) {
    say("received " + signalName(sig) + " while stopping; killing all ranks now");
    signalRunning(SIGKILL);
    return;
  }
  say("received " + signalName(sig) + "; forwarding it to all ranks");
  stop(sig, 128 + sig);
}

// Starts shutting the job down: records why, sends `sig` to every running
// rank's group, and arms the SIGKILL deadline. Only the first call counts.
void Job::stop(int sig, int exit_code) {
  if (stopping_) {
    return;
  }
  stopping_ = true;
  exit_code_ = exit_code;
  kill_deadline_ = Clock::now() + kGracePeriod;
  signalRunning(sig);
}

void Job::signalRunning(int sig) {
  for (const Rank& rank : ranks_) {
    if (rank.running) {
      signalRank(rank, sig);
    }
  }
}

void Job::readOutput(RankOutput& output) {
  char buf[64 * 1024];
  ssize_t n = ::read(output.fd, buf, sizeof(buf));
  if (n > 0) {
    if (!output.prefixer.feed(buf, static_cast<size_t>(n))) {
      // dtprun's stdout or stderr is gone (e.g. `dtprun ... | head`): stop
      // like a shell pipeline would, but without orphaning anything.
      stop(SIGTERM, 128 + SIGPIPE);
    }
  } else if (n == 0 || errno != EINTR) {
    closeOutput(output);
  }
}

void Job::drainAvailable(RankOutput& output) {
  while (output.fd >= 0) {
    pollfd fd{output.fd, POLLIN, 0};
    if (::poll(&fd, 1, 0) <= 0) {
      return;
    }
    readOutput(output);
  }
}

void Job::closeOutput(RankOutput& output) {
  if (output.fd < 0) {
    return;
  }
  output.prefixer.finish();
  ::close(output.fd);
  output.fd = -1;
}

bool Job::anyRunning() const {
  for (const Rank& rank : ranks_) {
    if (rank.running) {
      return true;
    }
  }
  return false;
}

bool Job::anyOutputOpen() const {
  for (const Rank& rank : ranks_) {
    if (rank.out.fd >= 0 || rank.err.fd >= 0) {
      return true;
    }
  }
  return false;
}

int Job::pollTimeoutMs(Clock::time_point now) const {
  std::optional<Clock::time_point> wake;
  for (const auto& deadline : {kill_deadline_, drain_deadline_}) {
    if (deadline && (!wake || *deadline < *wake)) {
      wake = deadline;
    }
  }
  if (!wake) {
    return -1;
  }
  auto left = std::chrono::ceil<std::chrono::milliseconds>(*wake - now).count();
  return static_cast<int>(std::max<decltype(left)>(0, left));
}

} // namespace

int run_ranks(const LaunchOptions& options, bool* interrupted) {
  Job job(options);
  const int code = job.run();
  if (interrupted != nullptr) *interrupted = job.interrupted();
  return code;
}

} // namespace dtprun
