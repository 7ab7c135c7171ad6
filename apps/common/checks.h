// Option checks for the apps whose errors read "--steps: must be a positive
// number, got '0'": CLI11's PositiveNumber and NonNegativeNumber print their
// range, whose upper bound is DBL_MAX written out in 300 digits.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

namespace dtp::apps {

inline CLI::Validator number_above(double bound, bool inclusive, const std::string& what, const std::string& name) {
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        try {
          size_t used = 0;
          const double v = std::stod(s, &used);
          if (used == s.size() && (inclusive ? v >= bound : v > bound)) return "";
        } catch (const std::exception&) {
        }
        return "must be " + what + ", got '" + s + "'";
      },
      name);
}

inline const CLI::Validator kPositive = number_above(0, false, "a positive number", "POSITIVE");
inline const CLI::Validator kNonNegative = number_above(0, true, "a non-negative number", "NONNEGATIVE");

}  // namespace dtp::apps
