// dtprun: a torchrun-style launcher for dtp programs. See --help.
#include <CLI/CLI.hpp>

#include <exception>
#include <fcntl.h>
#include <memory>
#include <string>
#include <unistd.h>

#include "io.h"
#include "launch_options.h"
#include "rank_env.h"
#include "supervisor.h"

namespace {

constexpr int kUsageError = 2;
constexpr int kDefaultMultiNodePort = 29500; // torchrun's default

constexpr const char* kDescription =
    "Runs N ranks of PROG on this machine with the torchrun environment, like\n"
    "`torchrun --nproc-per-node N PROG ARGS...`.";

constexpr const char* kFooter = R"(Everything from PROG on is passed to PROG untouched: in
`dtprun -n 2 ./train --lr 0.1 -n 3`, `-n 3` belongs to ./train. Put `--`
before PROG if its name starts with '-'.

Environment of each rank:
  RANK              node_rank * N + local rank
  WORLD_SIZE        nnodes * N
  LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the node rank)
  MASTER_ADDR, MASTER_PORT
  OMP_NUM_THREADS   unless already set: max(1, CPUs / N), so N ranks do not
                    oversubscribe the CPUs (dtprun says so on stderr)
  OMP_WAIT_POLICY   unless already set: PASSIVE when N > 1, so idle OpenMP
                    threads do not spin on CPUs other ranks need
Ranks read stdin from /dev/null.

Output: every line a rank writes is prefixed with "[rank R] " and kept on the
stream it was written to (stdout or stderr).

Restarts: with --max-restarts K, a failed job is started again up to K
times (all ranks of this machine; TORCHELASTIC_RESTART_COUNT tells them which
attempt, attempt k meets on --master-port + k). Resume from a checkpoint
there, e.g. dtp-train --save DIR --save-every N --resume DIR.

Failures: if a rank exits non-zero or is killed by a signal, dtprun names it,
sends SIGTERM to the other ranks and SIGKILL 3 s later, and exits with the
rank's status (128+signal if it was killed). SIGINT, SIGTERM and SIGHUP are
forwarded to all ranks the same way (a second one kills them at once), and
dtprun exits with 128+signal. Exit status 127: PROG cannot be executed;
2: wrong usage.

No orphans: each rank leads its own process group, and the whole group is
killed when the rank exits or is stopped. If dtprun itself is SIGKILLed, the
ranks die with it (PR_SET_PDEATHSIG), though processes they started may not.)";

// dtprun's usage takes PROG [ARGS...] from remaining(), not from declared
// positionals, so the default usage line would omit them.
class UsageFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App* /*app*/, std::string name) const override {
    return "Usage: " + name + " [OPTIONS] PROG [ARGS...]\n";
  }
};

// The ranks get fds 0-2 from dup2; if dtprun itself started with one closed,
// a pipe could land there and be clobbered. Fill any gap with /dev/null.
void ensureStandardFdsOpen() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) < 0) {
      ::open("/dev/null", O_RDWR); // takes the lowest free fd: this one
    }
  }
}

int usageError(const std::string& message) {
  dtprun::say(message + ". See dtprun --help");
  return kUsageError;
}

} // namespace

int main(int argc, char** argv) {
  ensureStandardFdsOpen();
  dtprun::LaunchOptions options;

  CLI::App app(kDescription, "dtprun");
  app.formatter(std::make_shared<UsageFormatter>());
  app.footer(kFooter);
  // The first word that is not one of our options is PROG; it and all after
  // it go to remaining() unparsed.
  app.prefix_command();
  app.add_option("-n,--nproc-per-node,--nproc_per_node", options.nproc_per_node, "Ranks to run on this machine (N)")
      ->capture_default_str();
  app.add_option("--nnodes", options.nnodes, "Machines in the job, each running its own dtprun")
      ->capture_default_str();
  app.add_option("--node-rank,--node_rank", options.node_rank, "This machine's index, 0 .. nnodes-1")
      ->capture_default_str();
  app.add_option("--master-addr,--master_addr", options.master_addr, "Address of the machine running rank 0")
      ->capture_default_str();
  CLI::Option* port_option = app.add_option("--master-port,--master_port", options.master_port,
                                            "Port rank 0 listens on [default: a free port if --nnodes is 1, "
                                            "else 29500]");
  app.add_option("--max-restarts,--max_restarts", options.max_restarts,
                 "After a rank fails, stop this machine's ranks and start them all again, up to this many times, "
                 "as torchrun --max-restarts (give every machine's dtprun the same value)")
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {
      return app.exit(e); // --help
    }
    return usageError(e.what());
  }

  options.command = app.remaining();
  bool had_separator = !options.command.empty() && options.command.front() == "--";
  if (had_separator) {
    options.command.erase(options.command.begin());
  }
  if (options.command.empty()) {
    return usageError("no program to run: got only dtprun's options. Name it after them, as in "
                      "'dtprun -n 2 ./train --lr 0.1'");
  }
  if (!had_separator && options.command.front().rfind('-', 0) == 0) {
    return usageError("unknown option: got '" + options.command.front() +
                      "'. dtprun's options come before PROG; put '--' before a PROG whose name starts with '-'");
  }
  if (options.nproc_per_node < 1) {
    return usageError("-n/--nproc-per-node must be at least 1: got " + std::to_string(options.nproc_per_node) +
                      ". Pass the number of ranks to run on this machine, e.g. -n 2");
  }
  if (options.nnodes < 1) {
    return usageError("--nnodes must be at least 1: got " + std::to_string(options.nnodes) +
                      ". Pass the number of machines in the job");
  }
  if (options.node_rank < 0 || options.node_rank >= options.nnodes) {
    return usageError("--node-rank must be in [0, --nnodes): got " + std::to_string(options.node_rank) +
                      " with --nnodes " + std::to_string(options.nnodes) + ". Number the machines 0 to " +
                      std::to_string(options.nnodes - 1));
  }
  bool port_given = port_option->count() > 0;
  if (port_given && (options.master_port < 1 || options.master_port > 65535)) {
    return usageError("--master-port must be in 1..65535: got " + std::to_string(options.master_port) +
                      ". Pass a free TCP port, or leave it out on a single machine to get one");
  }

  if (options.max_restarts < 0 || (port_given && options.master_port + options.max_restarts > 65535)) {
    return usageError("--max-restarts must be at least 0, and --master-port + --max-restarts at most 65535: got " +
                      std::to_string(options.max_restarts) + " with port " + std::to_string(options.master_port) +
                      ". Pass fewer restarts or a lower port");
  }

  try {
    if (!port_given) {
      options.master_port = options.nnodes == 1 ? dtprun::pick_free_port() : kDefaultMultiNodePort;
    }
    dtprun::default_omp_environment(options.nproc_per_node);
    // NOTE: [Restarts] Attempt k meets on MASTER_PORT + k: the machines of a
    // job restart one by one (each dtprun when its own ranks fail), and a
    // machine that restarted first must never join the store of the attempt
    // that failed, still served by the old rank 0 until it notices. Every
    // failure fails each machine's ranks (their collectives fail), so the
    // machines count attempts alike. On one machine, a fresh free port.
    const int base_port = options.master_port;
    for (;;) {
      bool interrupted = false;
      const int code = dtprun::run_ranks(options, &interrupted);
      if (code == 0 || interrupted || code == 127 || options.restart_count >= options.max_restarts) return code;
      ++options.restart_count;
      options.master_port = options.nnodes == 1 && !port_given ? dtprun::pick_free_port()
                                                               : base_port + options.restart_count;
      dtprun::say("restarting all " + std::to_string(options.nproc_per_node) + " ranks of this machine (restart " +
                  std::to_string(options.restart_count) + " of " + std::to_string(options.max_restarts) +
                  ", master port " + std::to_string(options.master_port) + ")");
    }
  } catch (const std::exception& e) {
    dtprun::say(e.what());
    return 1;
  }
}
