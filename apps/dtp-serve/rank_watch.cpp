#include "rank_watch.h"

#include <ATen/ATen.h>

#include <cerrno>
#include <csignal>
#include <fcntl.h>
#include <functional>
#include <unistd.h>

namespace dtp::serve {
namespace {

int64_t hostHash() {
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  return static_cast<int64_t>(std::hash<std::string>{}(name));
}

// A process that no longer exists, or has exited and waits for its parent to
// reap it (a zombie still answers kill(pid, 0)). Read with read(2): the
// process may vanish between open and read (ESRCH), which std::ifstream
// reports by throwing.
bool processGone(int64_t pid) {
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return true;
  char buf[512];
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return true;
  const std::string text(buf, static_cast<size_t>(n));
  const auto paren = text.rfind(')');  // "pid (comm) S ..."
  return paren != std::string::npos && paren + 2 < text.size() && (text[paren + 2] == 'Z' || text[paren + 2] == 'X');
}

}  // namespace

RankPids gather_rank_pids(const ProcessGroup& world) {
  const int64_t n = world.size();
  const at::Tensor mine = at::tensor(std::vector<int64_t>{static_cast<int64_t>(::getpid()), hostHash()}, at::kLong).view({1, 2});
  const at::Tensor all = n == 1 ? mine : world.all_gather(mine, 0, std::vector<int64_t>(n, 1)).wait();
  RankPids out;
  for (int64_t r = 0; r < n; ++r) {
    out.pid.push_back(all[r][0].item<int64_t>());
    out.same_host.push_back(all[r][1].item<int64_t>() == all[0][1].item<int64_t>());
  }
  return out;
}

std::string gone_rank(const RankPids& pids) {
  for (size_t r = 1; r < pids.pid.size(); ++r) {
    if (pids.same_host[r] && processGone(pids.pid[r]))
      return "rank " + std::to_string(r) + " (pid " + std::to_string(pids.pid[r]) + ")";
  }
  return "";
}

}  // namespace dtp::serve
