// Prefixes each line a rank writes with "[rank R] ".
#pragma once

#include <cstddef>
#include <string>
#include <utility>

namespace dtprun {

// Reassembles lines from the arbitrary chunks a pipe delivers and writes each
// complete line, prefixed, to `out_fd` in one write. Example: chunks "hel",
// "lo\nwor" then EOF on rank 1 give "[rank 1] hello\n[rank 1] wor\n".
class LinePrefixer {
 public:
  LinePrefixer(std::string prefix, int out_fd) : prefix_(std::move(prefix)), out_fd_(out_fd) {}

  // Writes the complete lines in `data` and keeps the unfinished tail. Returns
  // false if writing failed (dtprun's own output is gone).
  bool feed(const char* data, size_t size);

  // At EOF: writes an unfinished last line, adding the newline it lacked so
  // the next line does not run on after it.
  bool finish();

 private:
  bool writeLine(const char* begin, const char* end);

  std::string prefix_;
  int out_fd_;
  std::string partial_;
};

} // namespace dtprun
