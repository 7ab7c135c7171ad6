#include "peer_watch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>

namespace dtp::serve {
namespace {

// Whether `fd` is a TCP socket connected to addr:port.
bool isPeer(int fd, const std::string& addr, int port) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return false;
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return false;
  char text[INET6_ADDRSTRLEN] = {};
  int p = -1;
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, text, sizeof(text));
    p = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof(text));
    p = ntohs(a->sin6_port);
  } else {
    return false;
  }
  return p == port && addr == text;
}

}  // namespace

PeerWatch::PeerWatch(const std::string& remote_addr, int remote_port) : addr_(remote_addr), port_(remote_port) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    const int fd = std::atoi(e.path().filename().c_str());
    if (isPeer(fd, addr_, port_)) {
      fd_ = fd;
      return;
    }
  }
}

bool PeerWatch::closed() const {
  if (fd_ < 0 || !isPeer(fd_, addr_, port_)) return false;
  char byte;
  const ssize_t n = recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  // 0: an orderly shutdown; -1 with EAGAIN: open and quiet; > 0: it sent more (pipelining).
  return n == 0 || (n < 0 && errno == ECONNRESET);
}

}  // namespace dtp::serve
