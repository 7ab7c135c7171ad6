// Whole-line writes to file descriptors, shared by dtprun's own messages and
// the per-rank output it relays.
#pragma once

#include <string>

namespace dtprun {

// Writes all of `data` to `fd`, retrying short writes and EINTR. One call per
// line keeps lines from different ranks from interleaving: dtprun is the only
// writer to its stdout/stderr. Returns false if the fd is gone (e.g. EPIPE).
bool write_all(int fd, const std::string& data);

// Prints "dtprun: <message>\n" to stderr as one write.
void say(const std::string& message);

} // namespace dtprun
