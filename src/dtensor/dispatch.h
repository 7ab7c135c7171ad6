// The one way into dtp for ATen ops on DTensors.
#pragma once

namespace dtp {

// Registers the DTensor fallback with the dispatcher (idempotent, thread-safe).
// Called by every API entry point that creates DTensors.
void ensure_dtensor_dispatch();

}  // namespace dtp
