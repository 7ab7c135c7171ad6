// The message of a caught exception without libtorch's C++ backtrace, so that
// dtp's advice after it stays readable.
#pragma once

#include <c10/util/Exception.h>

#include <exception>

namespace dtp {

inline const char* error_text(const std::exception& e) {
  if (auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

}  // namespace dtp
