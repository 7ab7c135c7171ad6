// Rendezvous from the environment, as torchrun, mpirun and srun describe a job.
#include "dtp/process_group.h"

#include "comm/bind_address.h"
#include "comm/compat.h"
#include "comm/error_text.h"
#include "comm/job_env.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <cstdlib>
#include <iostream>
#include <optional>
#include <thread>

namespace dtp {
namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

// The first of `names` that is set, as an int; `what` names it in errors.
std::optional<int> envInt(std::initializer_list<const char*> names) {
  for (const char* n : names) {
    if (auto v = env(n)) {
      try {
        size_t used = 0;
        int x = std::stoi(*v, &used);
        if (used == v->size()) return x;
      } catch (const std::exception&) {
      }
      TORCH_CHECK(false, "dtp: environment variable ", n, "='", *v,
                  "' is not an integer. Set it to a non-negative integer.");
    }
  }
  return std::nullopt;
}

// NOTE: [Rendezvous phases] After joining the store a rank talks to its
// peers in two more phases before it has the world group: it counts the
// ranks that joined (rank 0's store), then connects the world group (Gloo's
// full mesh, every pair of ranks, addresses passed through the store; then
// the shared-memory or two-level setup, through the store again). A peer
// that closed its connection in either surfaced as a bare "Connection reset
// by peer" (c10d 1.13's store client reads end of file so, too), naming
// neither the phase nor the peer nor this rank: seen once in ~130 starts of
// 2 ranks on a loaded machine. Each phase now names itself and the peer:
// the store (rank 0, or torchrun's agent, at MASTER_ADDR:MASTER_PORT), or
// for Gloo's errors (their text names gloo) the rank Gloo names by its
// address. dtp's own errors ("dtp: ...") already say what failed and pass
// unchanged. No retry: c10d's store client does not reconnect, the store
// closes a connection when its process exits (or a request fails), and
// Gloo's pairs would have to be made again by every rank alike.
template <class Step>
auto inPhase(const std::string& rank_in_world, const std::string& store, const char* phase, Step&& step)
    -> decltype(step()) {
  try {
    return step();
  } catch (const std::exception& e) {
    const std::string err = error_text(e);
    if (err.rfind("dtp: ", 0) == 0) throw;
    const bool from_gloo = err.find("gloo") != std::string::npos || err.find("Gloo") != std::string::npos;
    throw compat::error_without_backtrace(c10::str(
        "dtp: rendezvous failed for ", rank_in_world, " while ", phase, ": got '", err, "' from ",
        from_gloo ? "a peer rank (Gloo names its address)" : store, ", expected ",
        from_gloo ? "every peer connected" : "its answer", ". That peer exited or crashed (see its output), or "
        "the connection was reset on an overloaded machine: start the job again."));
  }
}

}  // namespace

ProcessGroup init_process_group(const ProcessGroupOptions& options_in) {
  ProcessGroupOptions options = options_in;
  auto rank = envInt({"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"});
  auto world = envInt({"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"});
  TORCH_CHECK(rank.has_value() == world.has_value(),
              "dtp: found ", rank ? "RANK" : "WORLD_SIZE", " but not ",
              rank ? "WORLD_SIZE" : "RANK",
              " in the environment. Set both (dtprun and torchrun do), or neither for a "
              "single-process run.");
  if (!rank) {
    // A world of one needs no rendezvous: an in-process store, no listener,
    // so that single-process runs on one machine never collide on a port.
    std::cerr << "dtp: no RANK/WORLD_SIZE in the environment; running as a single process "
                 "(rank 0 of 1). Use dtprun -n N to start N ranks.\n";
    ProcessGroup alone = ProcessGroup::create(c10::make_intrusive<c10d::HashStore>(), 0, 1, options);
    set_default_process_group(alone);
    return alone;
  }
  TORCH_CHECK(*world >= 1 && *rank >= 0 && *rank < *world, "dtp: RANK=", *rank,
              " is outside [0, WORLD_SIZE=", *world, ").");

  // See NOTE: [Slurm across nodes] in job_env.cpp.
  const std::string addr = env("MASTER_ADDR") ? *env("MASTER_ADDR") : detail::slurm_master_addr().value_or("127.0.0.1");
  const int port = envInt({"MASTER_PORT"}).value_or(env("SLURM_JOB_ID")
                                                         ? detail::slurm_master_port(*env("SLURM_JOB_ID"))
                                                         : 29500);
  TORCH_CHECK(port > 0 && port < 65536, "dtp: MASTER_PORT=", port, " is not a valid port.");
  if (auto t = envInt({"DTP_TIMEOUT_S"})) options.timeout = std::chrono::seconds(*t);
  // See NOTE: [Choosing the interface] in bind_address.cpp.
  if (options.bind_address.empty()) options.bind_address = detail::choose_bind_address(addr);

  // Under torchrun's elastic agent (TORCHELASTIC_USE_AGENT_STORE=True) the
  // agent already serves a TCPStore on MASTER_ADDR:MASTER_PORT: every rank
  // joins it as a client, under the agent's per-attempt prefix, as PyTorch's
  // own workers do. Otherwise rank 0 serves the store.
  const bool agent_store = env("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(
        addr, compat::tcp_store_options(static_cast<uint16_t>(port), *rank == 0 && !agent_store,
                                      static_cast<size_t>(*world), options.timeout));
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "dtp: rendezvous failed for rank ", *rank, " of ", *world, " at ",
                addr, ":", port, " (timeout ", options.timeout.count() / 1000, " s", agent_store ? ", torchrun's agent store" : "",
                "): ", error_text(e),
                "\nCheck that all WORLD_SIZE ranks were started, that MASTER_ADDR/MASTER_PORT "
                "are the same everywhere and reachable, and that the port is free.");
  }
  if (agent_store) {
    store = c10::make_intrusive<c10d::PrefixStore>(
        "/worker/attempt_" + env("TORCHELASTIC_RESTART_COUNT").value_or("0"), store);
  }
  // See NOTE: [Rendezvous phases].
  const std::string rank_in_world = c10::str("rank ", *rank, " of ", *world, " at ", addr, ":", port);
  const std::string store_name = c10::str(agent_store ? "torchrun's agent store" : "rank 0's store", " (", addr, ":",
                                          port, ")");
  // libtorch 1.13's TCPStore stops waiting for workers silently: count the
  // ranks that joined so that a missing one is named here, after the timeout.
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  const int64_t joined = inPhase(rank_in_world, store_name, "counting the ranks that joined", [&] {
    int64_t n = store->add("dtp/joined", 1);
    while (n < *world && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      n = store->add("dtp/joined", 0);
    }
    return n;
  });
  TORCH_CHECK(joined >= *world, "dtp: rendezvous at ", addr, ":", port, " timed out after ",
              options.timeout.count() / 1000, " s: only ", joined, " of WORLD_SIZE=", *world,
              " ranks joined. Start every rank (dtprun -n ", *world, " ...), or raise DTP_TIMEOUT_S "
              "if they start slowly.");
  ProcessGroup world_group = inPhase(rank_in_world, store_name, "connecting the world group (Gloo's full mesh, then "
                                     "shared memory, through the store)",
                                     [&] { return ProcessGroup::create(store, *rank, *world, options); });
  set_default_process_group(world_group);
  return world_group;
}

}  // namespace dtp
