// Starts one rank: fork + execvp with its output on pipes.
#pragma once

#include <string>
#include <sys/types.h>
#include <vector>

namespace dtprun {

struct RankProcess {
  pid_t pid = -1; // also the id of the rank's own process group
  int out_fd = -1; // read ends of the rank's stdout and stderr
  int err_fd = -1;
};

struct SpawnResult {
  RankProcess process; // valid when error is empty
  std::string error; // e.g. "cannot execute 'foo': No such file or directory. <fix>"
};

// Runs `argv` (argv[0] looked up on PATH unless it contains '/') with
// environment `env`, stdin from /dev/null, and stdout/stderr on fresh pipes.
// The rank leads its own process group, so killpg() reaches anything it
// starts, and gets SIGKILL if dtprun dies. Returns once the exec has
// succeeded or failed, so a missing program is reported once, plainly,
// instead of as a rank exiting 127.
SpawnResult spawn_rank(const std::vector<std::string>& argv, const std::vector<std::string>& env);

} // namespace dtprun
