#include "rank_env.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <netinet/in.h>
#include <sched.h>
#include <stdexcept>
#include <sys/socket.h>
#include <unistd.h>

#include "io.h"

extern char** environ;

namespace dtprun {

namespace {

std::string portError(int err) {
  return std::string("cannot pick a free port on 127.0.0.1: got ") + std::strerror(err) + ". Pass --master-port";
}

} // namespace

int pick_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    throw std::runtime_error(portError(errno));
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    int err = errno;
    ::close(fd);
    throw std::runtime_error(portError(err));
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

namespace {

// CPUs this process may run on: respects taskset and cpuset limits, which the
// machine-wide count does not.
int usableCpus() {
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) {
    return CPU_COUNT(&set);
  }
  return static_cast<int>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)));
}

} // namespace

void default_omp_environment(int local_ranks) {
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    // N ranks that each start one OpenMP thread per CPU oversubscribe the
    // machine N times over; torchrun sets 1, which idles most CPUs instead.
    int cpus = usableCpus();
    int threads = std::max(1, cpus / local_ranks);
    ::setenv("OMP_NUM_THREADS", std::to_string(threads).c_str(), 1);
    say("setting OMP_NUM_THREADS=" + std::to_string(threads) + " for each rank (" +
        std::to_string(cpus) + " CPUs / " + std::to_string(local_ranks) +
        " local ranks); set OMP_NUM_THREADS yourself to override");
  }
  if (local_ranks > 1 && std::getenv("OMP_WAIT_POLICY") == nullptr) {
    // libgomp's idle threads spin by default and take the CPU another rank
    // waiting on a collective would get back.
    ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    say("setting OMP_WAIT_POLICY=PASSIVE (ranks share the CPUs); set it yourself to override");
  }
}

int global_rank(const LaunchOptions& options, int local_rank) {
  return options.node_rank * options.nproc_per_node + local_rank;
}

std::vector<std::string> rank_environment(const LaunchOptions& options, int local_rank) {
  std::map<std::string, std::string> rank_vars = {
      {"RANK", std::to_string(global_rank(options, local_rank))},
      {"WORLD_SIZE", std::to_string(options.nnodes * options.nproc_per_node)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(options.nproc_per_node)},
      {"GROUP_RANK", std::to_string(options.node_rank)},
      {"MASTER_ADDR", options.master_addr},
      {"MASTER_PORT", std::to_string(options.master_port)},
  };
  if (options.max_restarts > 0) {  // as torchrun tells its workers
    rank_vars["TORCHELASTIC_RESTART_COUNT"] = std::to_string(options.restart_count);
    rank_vars["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(options.max_restarts);
  }
  std::vector<std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    std::string kv = *entry;
    if (rank_vars.count(kv.substr(0, kv.find('='))) == 0) {
      env.push_back(std::move(kv));
    }
  }
  for (const auto& [key, value] : rank_vars) {
    env.push_back(key + "=" + value);
  }
  return env;
}

} // namespace dtprun
