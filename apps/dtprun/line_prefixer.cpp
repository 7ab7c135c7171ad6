#include "line_prefixer.h"

#include "io.h"

namespace dtprun {

namespace {

// A rank that writes without newlines (e.g. a '\r' progress bar) would
// otherwise grow the buffer forever; past this it is cut into lines.
constexpr size_t kMaxLine = 64 * 1024;

} // namespace

bool LinePrefixer::writeLine(const char* begin, const char* end) {
  std::string line;
  line.reserve(prefix_.size() + static_cast<size_t>(end - begin) + 1);
  line.append(prefix_).append(begin, end).push_back('\n');
  return write_all(out_fd_, line);
}

bool LinePrefixer::feed(const char* data, size_t size) {
  bool ok = true;
  partial_.append(data, size);
  size_t start = 0;
  size_t newline;
  while ((newline = partial_.find('\n', start)) != std::string::npos) {
    ok = writeLine(partial_.data() + start, partial_.data() + newline) && ok;
    start = newline + 1;
  }
  partial_.erase(0, start);
  while (partial_.size() >= kMaxLine) {
    ok = writeLine(partial_.data(), partial_.data() + kMaxLine) && ok;
    partial_.erase(0, kMaxLine);
  }
  return ok;
}

bool LinePrefixer::finish() {
  if (partial_.empty()) {
    return true;
  }
  bool ok = writeLine(partial_.data(), partial_.data() + partial_.size());
  partial_.clear();
  return ok;
}

} // namespace dtprun
