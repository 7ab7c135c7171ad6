// The fallback's side of dtp::ExplicitRedistributeGuard.
#pragma once

#include "dtensor/rule_registry.h"

namespace dtp {

// Reports (error or warning, per ExplicitRedistributeGuard::mode()) the
// inputs of `call` that decision `d` redistributes with a collective.
void check_implicit_redistribution(const OpCall& call, const Decision& d);

// True when the mode is not Off (one thread-local read on the hot path).
bool explicit_redistribute_active();

}  // namespace dtp
