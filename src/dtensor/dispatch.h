// The one way into dtp for ATen ops on DTensors.
#pragma once

#include <ATen/core/stack.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace dtp {

// Registers the DTensor fallback with the dispatcher (idempotent, thread-safe).
// Called by every API entry point that creates DTensors.
void ensure_dtensor_dispatch();

// Makes a non-ATen op (a user's TORCH_LIBRARY op) with a
// CompositeExplicitAutograd kernel reach the DTensor fallback, as
// ensure_dtensor_dispatch does for ATen's. Ops with backend kernels reach it
// already.
void route_to_dtensor_fallback(const c10::OperatorHandle& op);

namespace detail {
// The DTensor fallback: every ATen op on a DTensor lands here, below autograd.
void dtensor_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);
}  // namespace detail

}  // namespace dtp
