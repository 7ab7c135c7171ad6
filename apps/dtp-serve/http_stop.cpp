#include "http_stop.h"

#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdlib>

namespace dtp::serve {
namespace {

// The local port of `fd` when it is a connected TCP socket, else -1.
int connectedPort(int fd) {
  sockaddr_storage self{}, peer{};
  socklen_t n = sizeof(self), m = sizeof(peer);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&self), &n) != 0) return -1;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &m) != 0) return -1;  // a listener, or not connected
  if (self.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(self).sin_port);
  if (self.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(self).sin6_port);
  return -1;
}

}  // namespace

// NOTE: [Open connections at shutdown] cpp-httplib serves a connection on
// one worker thread, which after each response waits for the next request
// on it: up to the keep-alive timeout (5 s) when the client is idle, for as
// long as the client sends when it sends slowly. Debian 12's 0.11.4 does not
// look at Server::stop() while it waits, and stop() ends with the task queue
// joining its workers. So a client that keeps connections alive (OpenAI's
// Node client, browsers) held rank 0 for ~5.4 s after SIGTERM: past
// --shutdown-grace-s, past dtprun's SIGKILL at 3 s, and without the
// "dtp-serve: stopped" line.
// After stop() has closed the listening socket nothing more is accepted, and
// every connected socket of this process whose local port is the server's is
// one of its connections. shutdown(SHUT_RD) wakes the worker waiting on it:
// its read sees end of file and it closes the connection. Only the read side
// closes, so a response still being written (a stream's last events) goes out
// whole. The sockets are found in /proc/self/fd because cpp-httplib 0.11
// gives no handle on them (its per-connection hook, process_and_close_socket,
// is private). A worker may close one of them between our check and our
// shutdown(2), and another thread reuse its number in that window; at this
// point rank 0 opens no sockets, so that would need a descriptor opened in
// the microseconds between two system calls.
int stop_http(httplib::Server& server, int port) {
  server.stop();
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return 0;  // the workers then wait out their keep-alive timeout, as before
  int closed = 0;
  while (const dirent* entry = ::readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == ::dirfd(dir)) continue;
    if (connectedPort(static_cast<int>(fd)) == port && ::shutdown(static_cast<int>(fd), SHUT_RD) == 0) ++closed;
  }
  ::closedir(dir);
  return closed;
}

}  // namespace dtp::serve
