// Turns asynchronous signals into bytes on a pipe, so the supervisor's single
// poll() loop sees signals and rank output alike (the self-pipe trick).
#pragma once

#include <csignal>
#include <vector>

namespace dtprun {

class SignalPipe {
 public:
  // Routes SIGINT, SIGTERM, SIGHUP and SIGCHLD to the pipe and ignores
  // SIGPIPE, so a closed stdout shows up as a write error instead of killing
  // dtprun (which would leave the ranks' own children behind). Only one
  // SignalPipe may exist.
  SignalPipe();
  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;

  // Readable when a signal has arrived.
  int fd() const { return read_fd_; }

  // Signals received since the last call, oldest first.
  std::vector<int> drain();

  // For a forked child before exec: restores the default action of every
  // signal SignalPipe changed (an ignored SIGPIPE would survive exec) and
  // installs `mask`. Async-signal-safe.
  static void reset_in_child(const sigset_t& mask);

 private:
  int read_fd_ = -1;
};

} // namespace dtprun
