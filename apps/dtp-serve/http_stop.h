// Stopping rank 0's HTTP server at once, idle keep-alive clients included:
//   const int port = server.bind_to_any_port(host);
//   ...
//   stop_http(server, port);  // then the listen_after_bind thread returns
// NOTE: [Open connections at shutdown] in http_stop.cpp says why
// httplib::Server::stop() alone is not enough.
#pragma once

#include <httplib.h>

namespace dtp::serve {

// Stops `server` (listening on `port`) and closes the read side of each
// connection it still holds, so that the workers waiting on them return.
// Returns how many connections it closed.
int stop_http(httplib::Server& server, int port);

}  // namespace dtp::serve
