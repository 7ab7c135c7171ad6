// Runs the real dtprun binary on launcher_child (see its header comment for
// the modes) and checks exit codes, output, timing, and that no process
// outlives the job.
#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <map>
#include <poll.h>
#include <regex>
#include <sched.h>
#include <stdexcept>
#include <spawn.h>
#include <string>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::seconds;

// Generous: a hung dtprun fails the test instead of hanging it.
constexpr auto kRunTimeout = seconds(20);

struct Finished {
  int status = 0; // from waitpid
  std::string out;
  std::string err;
  Clock::time_point started;
  Clock::time_point ended;

  double seconds() const { return std::chrono::duration<double>(ended - started).count(); }
};

// Shell convention, as dtprun uses it: killed by signal S reads as 128+S.
int exitCode(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::vector<std::string> splitLines(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  size_t newline;
  while ((newline = text.find('\n', start)) != std::string::npos) {
    lines.push_back(text.substr(start, newline - start));
    start = newline + 1;
  }
  if (start < text.size()) {
    lines.push_back(text.substr(start));
  }
  return lines;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// dtprun started with its stdout and stderr on pipes to the test.
class Dtprun {
 public:
  Dtprun(const std::vector<std::string>& args, const std::vector<std::string>& env) {
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
      throw std::runtime_error("pipe2 failed");
    }
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&actions, err[1], STDERR_FILENO);
    std::vector<std::string> argv_strings = {DTPRUN_PATH};
    argv_strings.insert(argv_strings.end(), args.begin(), args.end());
    std::vector<char*> argv = cStrings(argv_strings);
    std::vector<char*> envp = cStrings(env);
    started_ = Clock::now();
    int rc = ::posix_spawn(&pid_, DTPRUN_PATH, &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    ::close(out[1]);
    ::close(err[1]);
    if (rc != 0) {
      throw std::runtime_error(std::string("posix_spawn " DTPRUN_PATH ": ") + std::strerror(rc));
    }
    out_fd_ = out[0];
    err_fd_ = err[0];
  }

  pid_t pid() const { return pid_; }

  // Reads both pipes to EOF, then reaps dtprun.
  Finished wait() {
    Finished finished;
    finished.started = started_;
    pollfd fds[2] = {{out_fd_, POLLIN, 0}, {err_fd_, POLLIN, 0}};
    std::string* sinks[2] = {&finished.out, &finished.err};
    const Clock::time_point deadline = Clock::now() + kRunTimeout;
    int open = 2;
    while (open > 0) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) {
        ADD_FAILURE() << "dtprun still running after " << kRunTimeout.count() << " s; killing it";
        ::kill(pid_, SIGKILL);
        break;
      }
      if (::poll(fds, 2, static_cast<int>(left)) < 0) {
        continue; // EINTR
      }
      for (int i = 0; i < 2; ++i) {
        if (fds[i].fd < 0 || fds[i].revents == 0) {
          continue;
        }
        char buf[4096];
        ssize_t n = ::read(fds[i].fd, buf, sizeof(buf));
        if (n > 0) {
          sinks[i]->append(buf, static_cast<size_t>(n));
        } else {
          ::close(fds[i].fd);
          fds[i].fd = -1; // poll() skips negative fds
          --open;
        }
      }
    }
    for (const pollfd& fd : fds) {
      if (fd.fd >= 0) {
        ::close(fd.fd);
      }
    }
    ::waitpid(pid_, &finished.status, 0);
    finished.ended = Clock::now();
    return finished;
  }

 private:
  static std::vector<char*> cStrings(const std::vector<std::string>& strings) {
    std::vector<char*> out;
    for (const std::string& s : strings) {
      out.push_back(const_cast<char*>(s.c_str()));
    }
    out.push_back(nullptr);
    return out;
  }

  pid_t pid_ = -1;
  int out_fd_ = -1;
  int err_fd_ = -1;
  Clock::time_point started_;
};

class DtprunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Orphaned grandchildren are reparented to the test instead of PID 1,
    // which in a container may never reap them; a zombie would still answer
    // kill(pid, 0) and look like a survivor.
    ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
    char dir[] = "/tmp/dtprun_test.XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    pid_dir_ = dir;
  }

  void TearDown() override {
    // Whatever a failed test left alive must not outlive it.
    for (pid_t pid : recordedPids()) {
      ::kill(pid, SIGKILL);
    }
    reapZombies();
    for (const std::string& name : pidFiles()) {
      std::remove((pid_dir_ + "/" + name).c_str());
    }
    ::rmdir(pid_dir_.c_str());
  }

  // Starts dtprun with the test's environment, minus OMP_NUM_THREADS and OMP_WAIT_POLICY, plus
  // `extra_env` ("KEY=value").
  Dtprun start(const std::vector<std::string>& args, const std::vector<std::string>& extra_env = {}) {
    std::vector<std::string> env;
    for (char** entry = environ; *entry != nullptr; ++entry) {
      std::string kv = *entry;
      if (kv.rfind("OMP_NUM_THREADS=", 0) != 0 && kv.rfind("OMP_WAIT_POLICY=", 0) != 0 &&
          kv.rfind("LAUNCHER_CHILD_", 0) != 0) {
        env.push_back(kv);
      }
    }
    env.push_back("LAUNCHER_CHILD_PID_DIR=" + pid_dir_);
    env.insert(env.end(), extra_env.begin(), extra_env.end());
    return Dtprun(args, env);
  }

  // Names of the "rank<R>" files that sleeping ranks wrote.
  std::vector<std::string> pidFiles() const {
    std::vector<std::string> names;
    for (int rank = 0; rank < 16; ++rank) {
      std::string name = "rank" + std::to_string(rank);
      if (::access((pid_dir_ + "/" + name).c_str(), F_OK) == 0) {
        names.push_back(name);
      }
    }
    return names;
  }

  // Ranks first, then their grandchildren.
  std::vector<pid_t> recordedPids(bool ranks_only = false) const {
    std::vector<pid_t> ranks, grandchildren;
    for (const std::string& name : pidFiles()) {
      std::ifstream in(pid_dir_ + "/" + name);
      pid_t rank_pid = 0, grandchild_pid = 0;
      if (in >> rank_pid >> grandchild_pid) {
        ranks.push_back(rank_pid);
        grandchildren.push_back(grandchild_pid);
      }
    }
    if (!ranks_only) {
      ranks.insert(ranks.end(), grandchildren.begin(), grandchildren.end());
    }
    return ranks;
  }

  bool waitForPidFiles(size_t count) const {
    const Clock::time_point deadline = Clock::now() + seconds(5);
    while (pidFiles().size() < count) {
      if (Clock::now() > deadline) {
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return true;
  }

  static void reapZombies() {
    while (::waitpid(-1, nullptr, WNOHANG) > 0) {
    }
  }

  // The pids among `pids` still alive after up to 2 s. Killed grandchildren
  // come to us as zombies; reaping them is what makes them vanish.
  static std::vector<pid_t> survivors(const std::vector<pid_t>& pids) {
    const Clock::time_point deadline = Clock::now() + seconds(2);
    for (;;) {
      reapZombies();
      std::vector<pid_t> alive;
      for (pid_t pid : pids) {
        if (!(::kill(pid, 0) == -1 && errno == ESRCH)) {
          alive.push_back(pid);
        }
      }
      if (alive.empty() || Clock::now() > deadline) {
        return alive;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  // Sends `sig` to dtprun once both sleeping ranks are up, and checks that
  // everything is gone within 5 s.
  void expectSignalStopsJob(int sig, const std::string& name) {
    Dtprun dtprun = start({"-n", "2", CHILD_PATH, "sleep"});
    ASSERT_TRUE(waitForPidFiles(2)) << "the ranks never started sleeping";
    Clock::time_point signalled = Clock::now();
    ::kill(dtprun.pid(), sig);
    Finished f = dtprun.wait();

    EXPECT_EQ(exitCode(f.status), 128 + sig) << f.err;
    EXPECT_LT(std::chrono::duration<double>(f.ended - signalled).count(), 5.0);
    EXPECT_TRUE(contains(f.err, "dtprun: received " + name + "; forwarding it to all ranks")) << f.err;
    for (int rank : {0, 1}) {
      std::string line = "[rank " + std::to_string(rank) + "] got signal " + std::to_string(sig) + "\n";
      EXPECT_TRUE(contains(f.out, line)) << "expected '" << line << "' in: " << f.out;
    }
    std::vector<pid_t> pids = recordedPids();
    EXPECT_EQ(pids.size(), 4u);
    EXPECT_EQ(survivors(pids), std::vector<pid_t>{});
  }

  std::string pid_dir_;
};

int expectedOmpThreads(int local_ranks) {
  cpu_set_t set;
  EXPECT_EQ(::sched_getaffinity(0, sizeof(set), &set), 0);
  return std::max(1, CPU_COUNT(&set) / local_ranks);
}

// rank -> KEY -> value, from "[rank R] KEY=value" lines; fails on any other line.
std::map<int, std::map<std::string, std::string>> parseEnvLines(const std::string& out) {
  static const std::regex line_re(R"(\[rank (\d+)\] (\w+)=(.*))");
  std::map<int, std::map<std::string, std::string>> env;
  for (const std::string& line : splitLines(out)) {
    std::smatch m;
    if (!std::regex_match(line, m, line_re)) {
      ADD_FAILURE() << "line without a rank prefix: '" << line << "'";
      continue;
    }
    env[std::stoi(m[1])][m[2]] = m[3];
  }
  return env;
}

TEST_F(DtprunTest, TwoRanksGetTorchrunEnvironmentAndPrefixedLines) {
  Finished f = start({"-n", "2", CHILD_PATH, "ok"}).wait();
  EXPECT_EQ(exitCode(f.status), 0) << f.err;

  auto env = parseEnvLines(f.out);
  ASSERT_EQ(env.size(), 2u) << f.out;
  for (int rank : {0, 1}) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    EXPECT_EQ(env[rank]["RANK"], std::to_string(rank));
    EXPECT_EQ(env[rank]["WORLD_SIZE"], "2");
    EXPECT_EQ(env[rank]["LOCAL_RANK"], std::to_string(rank));
    EXPECT_EQ(env[rank]["LOCAL_WORLD_SIZE"], "2");
    EXPECT_EQ(env[rank]["GROUP_RANK"], "0");
    EXPECT_EQ(env[rank]["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(env[rank]["OMP_NUM_THREADS"], std::to_string(expectedOmpThreads(2)));
    EXPECT_EQ(env[rank]["OMP_WAIT_POLICY"], "PASSIVE");
  }
  EXPECT_EQ(env[0]["MASTER_PORT"], env[1]["MASTER_PORT"]);
  EXPECT_GT(std::stoi(env[0]["MASTER_PORT"]), 0);

  // stderr stays on stderr, prefixed; dtprun's own lines say "dtprun: ".
  std::vector<std::string> err_lines = splitLines(f.err);
  for (const std::string& line : err_lines) {
    EXPECT_TRUE(line.rfind("[rank ", 0) == 0 || line.rfind("dtprun: ", 0) == 0) << line;
  }
  for (const char* expected : {"[rank 0] stderr line", "[rank 1] stderr line"}) {
    EXPECT_EQ(std::count(err_lines.begin(), err_lines.end(), expected), 1) << f.err;
  }
  EXPECT_TRUE(contains(f.err, "dtprun: setting OMP_NUM_THREADS=")) << f.err;
}

TEST_F(DtprunTest, KeepsOmpSettingsTheUserSet) {
  Finished f = start({"-n", "2", CHILD_PATH, "ok"}, {"OMP_NUM_THREADS=7", "OMP_WAIT_POLICY=ACTIVE"}).wait();
  EXPECT_EQ(exitCode(f.status), 0) << f.err;
  auto env = parseEnvLines(f.out);
  ASSERT_EQ(env.size(), 2u) << f.out;
  EXPECT_EQ(env[0]["OMP_NUM_THREADS"], "7");
  EXPECT_EQ(env[1]["OMP_NUM_THREADS"], "7");
  EXPECT_EQ(env[1]["OMP_WAIT_POLICY"], "ACTIVE");
  EXPECT_FALSE(contains(f.err, "OMP_NUM_THREADS")) << f.err;
  EXPECT_FALSE(contains(f.err, "OMP_WAIT_POLICY")) << f.err;
}

TEST_F(DtprunTest, PassesArgumentsAfterProgramUntouched) {
  Finished f =
      start({"-n", "2", CHILD_PATH, "args", "--foo", "-n", "3", "--", "--help", "two words", ""}).wait();
  EXPECT_EQ(exitCode(f.status), 0) << f.err;
  const std::vector<std::string> expected = {"arg[--foo]", "arg[-n]",        "arg[3]", "arg[--]",
                                             "arg[--help]", "arg[two words]", "arg[]"};
  for (int rank : {0, 1}) {
    std::string prefix = "[rank " + std::to_string(rank) + "] ";
    std::vector<std::string> got;
    for (const std::string& line : splitLines(f.out)) {
      if (line.rfind(prefix, 0) == 0) {
        got.push_back(line.substr(prefix.size()));
      }
    }
    EXPECT_EQ(got, expected) << f.out;
  }
}

TEST_F(DtprunTest, JoinsPartialWritesAndEndsUnterminatedLastLine) {
  Finished f = start({"-n", "1", CHILD_PATH, "partial"}).wait();
  EXPECT_EQ(exitCode(f.status), 0) << f.err;
  EXPECT_EQ(f.out, "[rank 0] hello\n[rank 0] no newline\n");
}

TEST_F(DtprunTest, RankFailureStopsOthersAndReportsStatus) {
  Finished f = start({"-n", "3", CHILD_PATH, "fail-rank", "1", "3"}).wait();
  EXPECT_EQ(exitCode(f.status), 3) << f.err;
  EXPECT_LT(f.seconds(), 5.0);
  // The rank's last words come first, then dtprun's summary.
  EXPECT_TRUE(std::regex_search(
      f.err,
      std::regex(R"(\[rank 1\] failing with 3\ndtprun: rank 1 \(pid \d+\) exited with status 3; stopping the other ranks\n)")))
      << f.err;
  EXPECT_TRUE(contains(f.out, "[rank 0] got signal 15\n")) << f.out;
  EXPECT_TRUE(contains(f.out, "[rank 2] got signal 15\n")) << f.out;
  std::vector<pid_t> pids = recordedPids();
  EXPECT_EQ(pids.size(), 4u) << "ranks 0 and 2 and their grandchildren";
  EXPECT_EQ(survivors(pids), std::vector<pid_t>{});
}

TEST_F(DtprunTest, RankKilledBySignalStopsOthersAndNamesSignal) {
  Finished f = start({"-n", "2", CHILD_PATH, "kill-rank", "1"}).wait();
  EXPECT_EQ(exitCode(f.status), 128 + SIGKILL) << f.err;
  EXPECT_LT(f.seconds(), 5.0);
  EXPECT_TRUE(std::regex_search(f.err, std::regex(R"(dtprun: rank 1 \(pid \d+\) was killed by signal 9 \(SIGKILL\))")))
      << f.err;
  std::vector<pid_t> pids = recordedPids();
  EXPECT_EQ(pids.size(), 2u) << "rank 0 and its grandchild";
  EXPECT_EQ(survivors(pids), std::vector<pid_t>{});
}

TEST_F(DtprunTest, KillsRanksThatIgnoreSigtermAfterGracePeriod) {
  Finished f = start({"-n", "2", CHILD_PATH, "fail-rank", "0", "5"}, {"LAUNCHER_CHILD_IGNORE_TERM=1"}).wait();
  EXPECT_EQ(exitCode(f.status), 5) << f.err;
  // Rank 1 and its grandchild ignore SIGTERM: only the SIGKILL sent after the
  // 3 s grace period can have ended them.
  EXPECT_GT(f.seconds(), 3.0);
  EXPECT_LT(f.seconds(), 5.0);
  std::vector<pid_t> pids = recordedPids();
  EXPECT_EQ(pids.size(), 2u);
  EXPECT_EQ(survivors(pids), std::vector<pid_t>{});
}

TEST_F(DtprunTest, ForwardsSigtermAndLeavesNoProcesses) {
  expectSignalStopsJob(SIGTERM, "SIGTERM");
}

TEST_F(DtprunTest, ForwardsSigintAndLeavesNoProcesses) {
  expectSignalStopsJob(SIGINT, "SIGINT");
}

TEST_F(DtprunTest, RanksDieWhenDtprunIsKilled) {
  Dtprun dtprun = start({"-n", "2", CHILD_PATH, "sleep"});
  ASSERT_TRUE(waitForPidFiles(2)) << "the ranks never started sleeping";
  ::kill(dtprun.pid(), SIGKILL);
  dtprun.wait();
  // PR_SET_PDEATHSIG covers the ranks only; TearDown kills the grandchildren.
  std::vector<pid_t> ranks = recordedPids(/*ranks_only=*/true);
  EXPECT_EQ(ranks.size(), 2u);
  EXPECT_EQ(survivors(ranks), std::vector<pid_t>{});
}

TEST_F(DtprunTest, UsageErrorsExitTwoAndNameTheOption) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{}, "dtprun: no program to run"},
      {{"-n", "2"}, "dtprun: no program to run"},
      {{"-n", "0", CHILD_PATH, "ok"}, "dtprun: -n/--nproc-per-node must be at least 1: got 0."},
      {{"--nnodes", "2", "--node-rank", "2", CHILD_PATH, "ok"}, "dtprun: --node-rank must be in [0, --nnodes): got 2"},
      {{"--bogus", CHILD_PATH, "ok"}, "dtprun: unknown option: got '--bogus'."},
  };
  for (const Case& c : cases) {
    Finished f = start(c.args).wait();
    EXPECT_EQ(exitCode(f.status), 2) << f.err;
    EXPECT_TRUE(contains(f.err, c.message)) << "expected '" << c.message << "' in: " << f.err;
    EXPECT_EQ(f.out, "");
  }
}

TEST_F(DtprunTest, MissingProgramIsReported) {
  for (const std::string prog : {"/nonexistent/prog", "dtprun-test-no-such-program"}) {
    Finished f = start({"-n", "2", prog}).wait();
    EXPECT_EQ(exitCode(f.status), 127) << f.err;
    EXPECT_TRUE(contains(f.err, "dtprun: cannot execute '" + prog + "': No such file or directory")) << f.err;
    EXPECT_LT(f.seconds(), 5.0);
  }
}

} // namespace
