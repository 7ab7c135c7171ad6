// The redistribute executor: runs a plan (redistribute_plan.h) on one rank's
// shard. The planner decides the steps; this file only carries them out.
#pragma once

#include "dtensor/pending_local.h"
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

// The same, with the plan's last collective left running (NOTE: [Async
// redistribution]): every collective before it completes now, the local
// steps after it run when the result is first used. Null when the plan has
// no collective on this mesh (run_redistribute then, at once).
std::shared_ptr<PendingLocal> run_redistribute_async(const at::Tensor& local, const SpecPtr& src,
                                                     const RedistributePlan& plan, bool consume = false);

// While one lives on this thread, redistribute(..., async_op=true) completes
// before it returns, as with async_op=false: the A/B of dtp-bench --async,
// and a first step when an async program hangs.
class SyncRedistributeScope {
 public:
  SyncRedistributeScope();
  ~SyncRedistributeScope();
  SyncRedistributeScope(const SyncRedistributeScope&) = delete;
  SyncRedistributeScope& operator=(const SyncRedistributeScope&) = delete;
  static bool active();

 private:
  bool prev_;
};

// run_redistribute with this thread's cached plan for src -> dst.
at::Tensor redistribute_local(const at::Tensor& local, const DTensorSpec& src,
                              const Placements& dst, bool backward = false, bool consume = false);

}  // namespace dtp
