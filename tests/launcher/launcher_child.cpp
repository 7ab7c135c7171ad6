// A stand-in rank for dtprun_tests; argv[1] picks the behaviour:
//   ok                   print the torchrun environment, one KEY=value a line,
//                        and one line on stderr; exit 0
//   args A...            print each argument as "arg[A]"; exit 0
//   partial              write "hello" in two pieces, then a last line with
//                        no newline; exit 0
//   fail-rank R CODE     rank R prints "failing with CODE" (no newline) on
//                        stderr and exits CODE once the others sleep
//   kill-rank R          rank R SIGKILLs itself once the others sleep
//   sleep                sleep
// Sleeping ranks fork a grandchild that sleeps too and record
// "<pid> <grandchild pid>" in $LAUNCHER_CHILD_PID_DIR/rank<R>, so a test can
// check that both are gone. On SIGINT or SIGTERM a sleeping rank prints
// "got signal N" and exits 0, so a test can see what was forwarded. With
// LAUNCHER_CHILD_IGNORE_TERM=1, rank and grandchild ignore SIGTERM instead, so
// only SIGKILL ends them.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unistd.h>

namespace {

int envInt(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::atoi(value) : -1;
}

[[noreturn]] void sleepForever() {
  for (;;) {
    ::pause();
  }
}

// Handles SIGINT and SIGTERM; async-signal-safe calls only.
void reportSignal(int sig) {
  const char* line = sig == SIGINT ? "got signal 2\n" : "got signal 15\n";
  (void)!::write(STDOUT_FILENO, line, std::strlen(line));
  ::_exit(0);
}

[[noreturn]] void sleepWithGrandchild() {
  bool ignore_term = envInt("LAUNCHER_CHILD_IGNORE_TERM") == 1;
  std::fflush(nullptr);
  pid_t grandchild = ::fork();
  if (grandchild == 0) {
    if (ignore_term) {
      std::signal(SIGTERM, SIG_IGN);
    }
    sleepForever();
  }
  std::signal(SIGINT, reportSignal);
  std::signal(SIGTERM, ignore_term ? SIG_IGN : reportSignal);
  const char* dir = std::getenv("LAUNCHER_CHILD_PID_DIR");
  if (dir != nullptr) {
    // Write then rename: the test never reads a half-written file.
    std::string path = std::string(dir) + "/rank" + std::to_string(envInt("RANK"));
    std::string tmp = path + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "w");
    std::fprintf(f, "%d %d\n", static_cast<int>(::getpid()), static_cast<int>(grandchild));
    std::fclose(f);
    std::rename(tmp.c_str(), path.c_str());
  }
  std::printf("sleeping\n");
  std::fflush(stdout);
  sleepForever();
}

// Waits until every other rank has recorded its pids, so a test always has
// the full set to check, however loaded the machine is.
void waitForOtherRanks() {
  const char* dir = std::getenv("LAUNCHER_CHILD_PID_DIR");
  if (dir == nullptr) {
    return;
  }
  for (int rank = 0; rank < envInt("WORLD_SIZE"); ++rank) {
    if (rank == envInt("RANK")) {
      continue;
    }
    std::string path = std::string(dir) + "/rank" + std::to_string(rank);
    for (int tries = 0; tries < 1000 && ::access(path.c_str(), F_OK) != 0; ++tries) {
      ::usleep(10 * 1000); // 10 s at most
    }
  }
}

void printEnv(const char* name) {
  const char* value = std::getenv(name);
  std::printf("%s=%s\n", name, value != nullptr ? value : "<unset>");
}

} // namespace

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "ok") {
    for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                             "MASTER_PORT", "OMP_NUM_THREADS", "OMP_WAIT_POLICY"}) {
      printEnv(name);
    }
    std::fprintf(stderr, "stderr line\n");
    return 0;
  }
  if (mode == "args") {
    for (int i = 2; i < argc; ++i) {
      std::printf("arg[%s]\n", argv[i]);
    }
    return 0;
  }
  if (mode == "partial") {
    std::printf("hel");
    std::fflush(stdout);
    ::usleep(100 * 1000); // the two halves reach dtprun as separate reads
    std::printf("lo\nno newline");
    return 0;
  }
  if (mode == "fail-rank" && argc == 4) {
    if (envInt("RANK") == std::atoi(argv[2])) {
      waitForOtherRanks();
      std::fprintf(stderr, "failing with %s", argv[3]); // no newline: the last words
      return std::atoi(argv[3]);
    }
    sleepWithGrandchild();
  }
  if (mode == "kill-rank" && argc == 3) {
    if (envInt("RANK") == std::atoi(argv[2])) {
      waitForOtherRanks();
      std::raise(SIGKILL);
    }
    sleepWithGrandchild();
  }
  if (mode == "sleep") {
    sleepWithGrandchild();
  }
  std::fprintf(stderr, "launcher_child: unknown mode: got '%s'. See the comment at the top of launcher_child.cpp.\n",
               mode.c_str());
  return 2;
}
