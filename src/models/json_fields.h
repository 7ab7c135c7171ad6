// Typed fields of a JSON config (Hugging Face's config.json, the config a
// dtp checkpoint records): a missing key or a value of another type (a float
// where an integer belongs, a string for a boolean) is an error naming the
// API, the file and the key, never a silent conversion (32.9 read as 32).
#pragma once

#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

#include <string>
#include <type_traits>

namespace dtp::models {

template <class T>
T json_field(const nlohmann::json& j, const std::string& api, const std::string& path, const char* key) {
  auto it = j.find(key);
  TORCH_CHECK(it != j.end() && !it->is_null(), api, ": '", path, "' has no \"", key, "\". Add it.");
  const bool typed = std::is_same_v<T, bool> ? it->is_boolean()
                     : std::is_integral_v<T> ? it->is_number_integer()
                     : std::is_floating_point_v<T> ? it->is_number()
                                                   : it->is_string();
  TORCH_CHECK(typed, api, ": '", path, "': \"", key, "\" is ", it->dump(), ", expected ",
              std::is_same_v<T, bool> ? "a boolean (true or false)"
              : std::is_integral_v<T> ? "an integer"
              : std::is_floating_point_v<T> ? "a number"
                                            : "a string",
              ". Fix the value in the file.");
  return it->get<T>();
}

template <class T>
T json_field_or(const nlohmann::json& j, const std::string& api, const std::string& path, const char* key,
                T fallback) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? fallback : json_field<T>(j, api, path, key);
}

}  // namespace dtp::models
