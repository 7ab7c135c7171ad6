// Precompiled header for dtp's own translation units: the heavy ATen and c10d
// headers (not gloo's: only src/comm/gloo.h needs them).
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
