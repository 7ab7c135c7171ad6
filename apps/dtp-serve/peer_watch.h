// NOTE: [A client that hangs up] A non-streamed request holds its HTTP
// thread until the engine finishes it; a client that closes its connection
// meanwhile should free its row, as a streamed one does when a write
// fails. Debian 12's cpp-httplib (0.11) tells a handler nothing about its
// connection, so PeerWatch finds the handler's socket itself: the one of
// this process whose peer is the request's remote address and port
// (getpeername over /proc/self/fd, once), then asks it, at each look,
// whether the peer sent its FIN (recv with MSG_PEEK | MSG_DONTWAIT returns
// 0). It checks the peer again at each look, so a descriptor closed and
// reused by another connection reads as "not closed": a missed cancel, never
// a wrong one. Without a socket found, closed() is always false.
#pragma once

#include <string>

namespace dtp::serve {

class PeerWatch {
 public:
  PeerWatch(const std::string& remote_addr, int remote_port);
  // Whether the client closed its side of the connection.
  bool closed() const;

 private:
  std::string addr_;
  int port_;
  int fd_ = -1;
};

}  // namespace dtp::serve
