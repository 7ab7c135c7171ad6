// The precompiled header of dtp_tests (and dtp_cuda_tests, which reuses it):
// what most test files include, parsed once per build instead of once per
// file (NOTE: [Test build flags] in tests/CMakeLists.txt).
#pragma once
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dist.h"
#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
