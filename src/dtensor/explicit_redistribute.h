// The fallback's side of dtp::ExplicitRedistributeGuard.
#pragma once

#include "dtensor/sharding_prop.h"

namespace dtp {

// Reports (error or warning, per ExplicitRedistributeGuard::mode()) the
// inputs of `call` that decision `d`'s plans redistribute with a collective
// (the plans the fallback then runs: nothing is planned again).
void check_implicit_redistribution(const OpCall& call, const PlannedDecision& d);

// True when the mode is not Off (one thread-local read on the hot path).
bool explicit_redistribute_active();

}  // namespace dtp
