// The redistribute executor: runs a plan (redistribute_plan.h) on one rank's
// shard. The planner decides the steps; this file only carries them out.
#pragma once

#include "dtensor/redistribute_plan.h"

#include <ATen/core/Tensor.h>

namespace dtp {

// This rank's shard of `plan.dst` computed from its shard `local` of `src`,
// by the plan's steps in order (the plan must be one for src's placements).
// `backward`: the transition runs on a gradient, where R -> P keeps the value
// on every rank (each rank's partial contributed the whole gradient).
// `consume`: nothing else sees `local` (solely_owned), so P -> R reduces it in
// place instead of into a copy.
at::Tensor run_redistribute(const at::Tensor& local, const DTensorSpec& src, const RedistributePlan& plan,
                            bool backward = false, bool consume = false);

// run_redistribute with this thread's cached plan for src -> dst.
at::Tensor redistribute_local(const at::Tensor& local, const DTensorSpec& src,
                              const Placements& dst, bool backward = false, bool consume = false);

}  // namespace dtp
