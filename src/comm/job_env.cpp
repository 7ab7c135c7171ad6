#include "comm/job_env.h"

#include <c10/util/Exception.h>

#include <cctype>
#include <cstdlib>

namespace dtp::detail {

// NOTE: [Slurm across nodes] srun sets SLURM_PROCID/SLURM_NTASKS (read as
// RANK/WORLD_SIZE) but no MASTER_ADDR: left at 127.0.0.1, every node would
// meet only itself. Rank 0 (SLURM_PROCID 0) runs on the first node of the
// step, so that node's name is MASTER_ADDR: SLURM_STEP_NODELIST first (a
// step may use fewer nodes than its job, but always starts at the job's
// first), then SLURM_JOB_NODELIST (and SLURM_NODELIST, its older name).
// Host lists come compressed: "node[01-03,07],gpu5" is node01 node02 node03
// node07 gpu5; only the first is needed, and it keeps its zero padding.
// MASTER_PORT comes from SLURM_JOB_ID so that two jobs on one node do not
// collide on 29500. LOCAL_RANK (the GPU of the rank, NOTE: [The rank's
// device]) comes from SLURM_LOCALID.

std::string first_slurm_host(const std::string& nodelist) {
  auto bad = [&](const char* what) {
    TORCH_CHECK(false, "dtp: Slurm host list '", nodelist, "': ", what,
                ", expected a list like 'node[01-03,07],gpu5'. Set MASTER_ADDR to rank 0's host instead.");
  };
  std::string host;
  size_t i = 0;
  while (i < nodelist.size() && nodelist[i] != ',') {
    const char c = nodelist[i];
    if (c == ']') bad("a ']' without its '['");
    if (c != '[') {
      host += c;
      ++i;
      continue;
    }
    const size_t close = nodelist.find(']', i);
    if (close == std::string::npos) bad("a '[' without its ']'");
    // The group's first item, and of a range "01-03" its start "01".
    const std::string group = nodelist.substr(i + 1, close - i - 1);
    const std::string first = group.substr(0, group.find_first_of(",-"));
    if (first.empty()) bad("an empty range");
    for (char d : first)
      if (!std::isdigit(static_cast<unsigned char>(d))) bad("a range that is not numeric");
    host += first;
    i = close + 1;
  }
  if (host.empty()) bad("no first host");
  return host;
}

namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

}  // namespace

std::optional<std::string> slurm_master_addr() {
  for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"})
    if (auto list = env(name)) return first_slurm_host(*list);
  return std::nullopt;
}

int slurm_master_port(const std::string& job_id) {
  const std::string tail = job_id.size() > 4 ? job_id.substr(job_id.size() - 4) : job_id;
  bool numeric = !tail.empty();
  for (char d : tail) numeric = numeric && std::isdigit(static_cast<unsigned char>(d));
  TORCH_CHECK(numeric, "dtp: SLURM_JOB_ID='", job_id, "' does not end in digits, expected a job number. ",
              "Set MASTER_PORT.");
  return 15000 + std::stoi(tail);
}

std::optional<int> local_rank(std::string* name) {
  for (const char* n : {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"}) {
    auto v = env(n);
    if (!v) continue;
    size_t used = 0;
    int x = -1;
    try {
      x = std::stoi(*v, &used);
    } catch (const std::exception&) {
    }
    TORCH_CHECK(x >= 0 && used == v->size(), "dtp: ", n, "='", *v,
                "' is not a rank on this node, expected a non-negative integer. Fix or unset it.");
    if (name != nullptr) *name = n;
    return x;
  }
  return std::nullopt;
}

}  // namespace dtp::detail
