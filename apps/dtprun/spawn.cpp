#include "spawn.h"

#include <cerrno>
#include <csignal>
#include <cstring>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "signal_pipe.h"

extern char** environ;

namespace dtprun {

namespace {

// The child's steps up to exec, named for error messages.
enum Step : int { kSetpgid, kPrctl, kOpenDevNull, kDup2, kExec };
constexpr const char* kStepNames[] = {"setpgid", "prctl", "open /dev/null", "dup2", "exec"};

// What the child reports on the status pipe when a step fails.
struct ChildFailure {
  int step;
  int err; // errno
};

std::vector<char*> cStrings(const std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (const std::string& s : strings) {
    out.push_back(const_cast<char*>(s.c_str()));
  }
  out.push_back(nullptr);
  return out;
}

[[noreturn]] void reportAndExit(int status_w, int step) {
  ChildFailure failure{step, errno};
  (void)!::write(status_w, &failure, sizeof(failure));
  ::_exit(127);
}

// Runs in the forked child: only async-signal-safe calls, no allocation.
[[noreturn]] void execChild(
    char** argv, char** envp, pid_t parent, const sigset_t& mask, int out_w, int err_w, int status_w) {
  SignalPipe::reset_in_child(mask);
  // Own process group: dtprun's killpg() then reaches the rank's children,
  // and a terminal's Ctrl-C reaches dtprun alone, which forwards it.
  if (::setpgid(0, 0) != 0) {
    reportAndExit(status_w, kSetpgid);
  }
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) {
    reportAndExit(status_w, kPrctl);
  }
  // dtprun may have died before prctl took effect; then no signal will come.
  if (::getppid() != parent) {
    ::_exit(127);
  }
  // stdin from /dev/null: a rank outside the terminal's foreground process
  // group that read the terminal would be stopped by SIGTTIN and hang the job.
  int null_fd = ::open("/dev/null", O_RDONLY);
  if (null_fd < 0) {
    reportAndExit(status_w, kOpenDevNull);
  }
  if (::dup2(null_fd, STDIN_FILENO) < 0 || ::dup2(out_w, STDOUT_FILENO) < 0 ||
      ::dup2(err_w, STDERR_FILENO) < 0) {
    reportAndExit(status_w, kDup2);
  }
  // Every other descriptor dtprun holds is O_CLOEXEC and vanishes here.
  environ = envp;
  ::execvp(argv[0], argv);
  reportAndExit(status_w, kExec);
}

} // namespace

SpawnResult spawn_rank(const std::vector<std::string>& argv, const std::vector<std::string>& env) {
  // Built before fork: the child must not allocate.
  std::vector<char*> c_argv = cStrings(argv);
  std::vector<char*> c_env = cStrings(env);

  SpawnResult result;
  // Each pipe: [0] read end kept by dtprun, [1] write end given to the child.
  int out[2], err[2], status[2];
  int* pipes[] = {out, err, status};
  for (int i = 0; i < 3; ++i) {
    if (::pipe2(pipes[i], O_CLOEXEC) != 0) {
      result.error = std::string("cannot create a pipe: ") + std::strerror(errno);
      for (int j = 0; j < i; ++j) {
        ::close(pipes[j][0]);
        ::close(pipes[j][1]);
      }
      return result;
    }
  }

  // Block signals across fork so no dtprun handler runs in the child before
  // reset_in_child() restores the defaults.
  sigset_t all, old_mask;
  sigfillset(&all);
  ::sigprocmask(SIG_SETMASK, &all, &old_mask);
  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid == 0) {
    execChild(c_argv.data(), c_env.data(), parent, old_mask, out[1], err[1], status[1]);
  }
  int fork_errno = errno;
  ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
  for (int* p : pipes) {
    ::close(p[1]);
  }
  if (pid < 0) {
    result.error = std::string("cannot fork: ") + std::strerror(fork_errno);
    for (int* p : pipes) {
      ::close(p[0]);
    }
    return result;
  }

  // EOF means exec succeeded (the O_CLOEXEC write end closed); a record means
  // the child failed before or at exec and has exited.
  ChildFailure failure{};
  ssize_t n;
  do {
    n = ::read(status[0], &failure, sizeof(failure));
  } while (n < 0 && errno == EINTR);
  ::close(status[0]);
  if (n == static_cast<ssize_t>(sizeof(failure))) {
    ::waitpid(pid, nullptr, 0);
    ::close(out[0]);
    ::close(err[0]);
    if (failure.step == kExec) {
      result.error = "cannot execute '" + argv[0] + "': " + std::strerror(failure.err) +
          ". Check the program name, that it is executable, and PATH";
    } else {
      result.error = std::string("cannot start a rank: ") + kStepNames[failure.step] + ": " +
          std::strerror(failure.err);
    }
    return result;
  }
  result.process = RankProcess{pid, out[0], err[0]};
  return result;
}

} // namespace dtprun
