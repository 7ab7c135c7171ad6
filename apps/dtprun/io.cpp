#include "io.h"

#include <cerrno>
#include <unistd.h>

namespace dtprun {

bool write_all(int fd, const std::string& data) {
  const char* p = data.data();
  size_t left = data.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      return false;
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  return true;
}

void say(const std::string& message) {
  write_all(STDERR_FILENO, "dtprun: " + message + "\n");
}

} // namespace dtprun
