// Reading the kernel's per-process and machine figures from /proc, for the
// apps' memory reports.
#pragma once

#include <fstream>
#include <string>

namespace dtp::apps {

// A "Key: value kB" field of a /proc file (0 when missing), in kB:
// proc_field_kb("/proc/self/status", "VmRSS:").
inline double proc_field_kb(const char* file, const std::string& field) {
  std::ifstream in(file);
  std::string key;
  while (in >> key) {
    if (key == field) {
      double kb = 0;
      in >> kb;
      return kb;
    }
    in.ignore(1 << 20, '\n');
  }
  return 0.0;
}

}  // namespace dtp::apps
