#include "comm/result_tape.h"

#include <c10/util/Exception.h>

namespace dtp::detail {
namespace {
thread_local ResultTape* tapes[2] = {nullptr, nullptr};
}  // namespace

const at::Tensor& ResultTape::pop() {
  TORCH_CHECK(next_ < results_.size(), "dtp: a checkpointed function issued more collectives or saved ops "
              "when recomputed (",
              next_ + 1, ") than in its first pass (", results_.size(), "). It must take the same path both "
              "times; use ACMode::Full for functions that do not.");
  return results_[next_++];
}

ResultTape* active_tape(TapeKind kind) { return tapes[static_cast<int>(kind)]; }

TapeScope::TapeScope(ResultTape* t, TapeKind kind) : kind_(kind), prev_(tapes[static_cast<int>(kind)]) {
  tapes[static_cast<int>(kind)] = t;
}
TapeScope::~TapeScope() { tapes[static_cast<int>(kind_)] = prev_; }

}  // namespace dtp::detail
