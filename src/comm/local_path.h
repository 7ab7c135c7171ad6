// The face the in-memory paths (NOTE: [Shared-memory collectives] and NOTE:
// [Two-level collectives]) show the collective pipeline (NOTE: [Collective
// pipeline] in collective_pipeline.h): synchronous collectives on flat,
// contiguous CPU buffers of the group's ranks. c10d's backends (Gloo, NCCL)
// are the other path; they show c10d::Backend.
#pragma once

#include "dtp/process_group.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace dtp::detail {

class LocalPath {
 public:
  virtual ~LocalPath() = default;

  // The largest message (bytes a rank puts in per collective) the path takes.
  virtual int64_t max_bytes() const = 0;
  // In place on `flat` (contiguous, 1-D, a dtype ATen reduces), every rank's
  // reduced in rank order: identical bits everywhere. Avg divides the sum by
  // the group size.
  virtual void all_reduce(at::Tensor& flat, ReduceOp op) = 0;
  // Rank r's `flat` (numels[r] elements, contiguous) into out[r]: out is 1-D
  // with sum(numels) elements.
  virtual void all_gather(const at::Tensor& flat, const std::vector<int64_t>& numels, at::Tensor& out) = 0;
  // `flat` is split into pieces of `numels`; returns the reduction of every
  // rank's piece `rank` (rank order).
  virtual at::Tensor reduce_scatter(const at::Tensor& flat, const std::vector<int64_t>& numels, ReduceOp op) = 0;
  // all_to_all with per-peer element counts, which differ between ranks:
  // `flat` holds this rank's pieces for ranks 0, 1, ... (send[q] elements
  // each); `out` (sum(recv) elements) receives rank r's piece for this rank
  // (recv[r] elements) in rank order. False, alike on every member and
  // before anything moved, when the path cannot carry this exchange: c10d
  // carries it then.
  virtual bool all_to_all(const at::Tensor& flat, const std::vector<int64_t>& send, const std::vector<int64_t>& recv,
                          at::Tensor& out) = 0;
  // In place from `src`.
  virtual void broadcast(at::Tensor& flat, int src) = 0;
  virtual void barrier() = 0;
};

}  // namespace dtp::detail
