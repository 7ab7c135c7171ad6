#include "dtensor/dispatch_context.h"

#include "dtensor/mix_hint.h"

namespace dtp::detail {

DispatchContext& dispatch_context() {
  thread_local DispatchContext context;  // NOTE: [Dispatch context]
  return context;
}

std::shared_ptr<const std::string>& mix_hint() { return dispatch_context().mix_hint; }

}  // namespace dtp::detail
