#include "signal_pipe.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <stdexcept>
#include <string>
#include <unistd.h>

namespace dtprun {

namespace {

constexpr int kRoutedSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD};

int g_write_fd = -1;

void onSignal(int sig) {
  int saved_errno = errno;
  unsigned char byte = static_cast<unsigned char>(sig);
  // Non-blocking, so the handler can never hang; filling the pipe would take
  // 64 Ki unread signals.
  (void)!::write(g_write_fd, &byte, 1);
  errno = saved_errno;
}

} // namespace

SignalPipe::SignalPipe() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    throw std::runtime_error(std::string("cannot create the signal pipe: got ") + std::strerror(errno));
  }
  read_fd_ = fds[0];
  g_write_fd = fds[1];

  struct sigaction action {};
  action.sa_handler = onSignal;
  sigemptyset(&action.sa_mask);
  // SA_RESTART keeps blocking reads and waits from failing with EINTR; poll()
  // still returns early, which is what wakes the loop.
  action.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  for (int sig : kRoutedSignals) {
    ::sigaction(sig, &action, nullptr);
  }
  ::signal(SIGPIPE, SIG_IGN);
}

std::vector<int> SignalPipe::drain() {
  std::vector<int> signals;
  unsigned char buf[64];
  ssize_t n;
  while ((n = ::read(read_fd_, buf, sizeof(buf))) > 0) {
    signals.insert(signals.end(), buf, buf + n);
  }
  return signals;
}

void SignalPipe::reset_in_child(const sigset_t& mask) {
  for (int sig : kRoutedSignals) {
    ::signal(sig, SIG_DFL);
  }
  ::signal(SIGPIPE, SIG_DFL);
  ::sigprocmask(SIG_SETMASK, &mask, nullptr);
}

} // namespace dtprun
