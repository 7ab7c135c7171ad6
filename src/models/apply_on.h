// How the models' apply_* helpers call a technique on one module: an error
// starts with the entry point the user called and the module's FQN
// ("apply_fsdp: layers.3: fully_shard: ..."), which the technique, seeing
// only the module, cannot know.
#pragma once

#include <c10/util/Exception.h>

#include <string>

namespace dtp::models::detail {

template <class F>
void apply_on(const char* api, const std::string& fqn, F&& apply) {
  try {
    apply();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, api, ": ", fqn.empty() ? std::string("the model") : fqn, ": ", e.msg());
  }
}

}  // namespace dtp::models::detail
