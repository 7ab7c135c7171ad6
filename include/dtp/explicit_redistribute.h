// The explicit-redistribution mode: an op whose sharding rule needs its
// inputs in other placements than they are, at the cost of a collective, is
// an error (or a warning, once per op and input specs) instead of a hidden
// redistribution. Redistributions a user or a TP style asks for
// (dtp::redistribute, PrepareModuleInput, the styles' output layouts) stay
// allowed, so a model whose plan places every tensor where its ops want it
// runs clean, and every collective in it is one somebody wrote down.
//
//   dtp::ExplicitRedistributeGuard strict;  // or DTP_EXPLICIT_REDISTRIBUTE=1
//   a + b;  // a S(0), b S(1): "dtp: aten::add.Tensor would redistribute
//           //  implicitly: input 1 f32[4,6](S(1)) ... all_to_all on mesh dim 0 ..."
// (at::mm of S(1) by R needs none: b's rows are sliced locally and the
// result is Partial.)
//
// Changes that need no collective (R to a shard: a local slice; any change
// on a one-rank mesh dim) are not flagged.
#pragma once

namespace dtp {

enum class ExplicitRedistributeMode { Off, Warn, Error };

// Inside this scope (on this thread), implicit redistributions are `mode`;
// the innermost live guard decides, whatever order guards are destroyed in.
// Outside, the environment decides: DTP_EXPLICIT_REDISTRIBUTE=1 (Error) or
// =warn (Warn); unset or 0: Off.
class ExplicitRedistributeGuard {
 public:
  explicit ExplicitRedistributeGuard(ExplicitRedistributeMode mode = ExplicitRedistributeMode::Error);
  ~ExplicitRedistributeGuard();
  ExplicitRedistributeGuard(const ExplicitRedistributeGuard&) = delete;
  ExplicitRedistributeGuard& operator=(const ExplicitRedistributeGuard&) = delete;
  static ExplicitRedistributeMode mode();
};

}  // namespace dtp
