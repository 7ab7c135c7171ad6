// The message of a caught exception without libtorch's C++ backtrace, so that
// dtp's advice after it stays readable.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <string>
#include <vector>

namespace dtp {

inline const char* error_text(const std::exception& e) {
  if (auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

// "a, b, c" for an error message: the first 20 names, then the count.
inline std::string name_list(const std::vector<std::string>& names) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < 20; ++i) s += (i ? ", " : "") + names[i];
  return names.size() > 20 ? s + ", ... (" + std::to_string(names.size()) + " in all)" : s;
}

}  // namespace dtp
