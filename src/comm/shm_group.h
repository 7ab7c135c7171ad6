// Collectives through POSIX shared memory for the ranks of a group that share
// a host: small CPU messages at memory speed instead of a Gloo round trip
// over loopback TCP. See NOTE: [Shared-memory collectives] in shm_group.cpp.
#pragma once

#include "comm/local_path.h"
#include "dtp/process_group.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

namespace dtp::detail {

// Largest message (bytes a rank puts in per collective) the path takes:
// DTP_SHM_MAX_BYTES (read when a group is made), else kShmDefaultMaxBytes.
// Also the size of each slot: a group's segment is 2 x ranks x this.
int64_t shm_max_bytes();
inline constexpr int64_t kShmDefaultMaxBytes = int64_t{4} << 20;

// What identifies this rank's host: its hostname, kernel boot id and the
// device and inode of its /dev/shm (ranks that agree can share a POSIX
// shared-memory segment; simulated hosts with a /dev/shm each differ).
std::string host_key();

// Tests run ranks as threads of one process: while one lives, host_key() on
// this thread answers `key` instead.
class HostKeyOverride {
 public:
  explicit HostKeyOverride(std::string key);
  ~HostKeyOverride();
  HostKeyOverride(const HostKeyOverride&) = delete;
  HostKeyOverride& operator=(const HostKeyOverride&) = delete;

 private:
  std::string key_;
};

struct ShmRankLine;

// FNV-1a over the words describing a call, which every member publishes with
// its arrival (NOTE: [Shared-memory collectives]).
uint64_t shm_call_hash(std::initializer_list<int64_t> words, const std::vector<int64_t>& sizes = {});

class ShmGroup final : public LocalPath {
 public:
  // Every member calls it (through `store`, the group's own prefix): the
  // segment, or null on every member where they are not all on one host
  // (host_key() differs from group rank 0's, or its segment cannot be opened),
  // DTP_SHM=0, or the segment cannot be made (said on stderr).
  static std::shared_ptr<ShmGroup> connect(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                           std::chrono::milliseconds timeout);
  ~ShmGroup() override;
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  int64_t max_bytes() const override { return slot_bytes_; }

  // In place on `flat` (contiguous, 1-D, a dtype ATen reduces), every rank's
  // reduced in rank order 0, 1, ... on every rank: identical bits everywhere.
  // Avg divides the sum by the group size.
  void all_reduce(at::Tensor& flat, ReduceOp op) override;
  // Rank r's `flat` (numels[r] elements, contiguous) into out[r]: out is
  // 1-D with sum(numels) elements.
  void all_gather(const at::Tensor& flat, const std::vector<int64_t>& numels, at::Tensor& out) override;
  // `flat` is split into pieces of `numels`; returns the reduction of every
  // rank's piece `rank` (rank order).
  at::Tensor reduce_scatter(const at::Tensor& flat, const std::vector<int64_t>& numels, ReduceOp op) override;
  // In two rounds: every rank's send and receive counts (so every member
  // sees the whole exchange and declines alike when a rank's pieces exceed
  // its slot), then the pieces. See shm_all_to_all.cpp.
  bool all_to_all(const at::Tensor& flat, const std::vector<int64_t>& send, const std::vector<int64_t>& recv,
                  at::Tensor& out) override;
  // In place from `src`.
  void broadcast(at::Tensor& flat, int src) override;
  void barrier() override;

  // Marks this rank failed in the segment: every member waiting for it, now
  // or later, throws at once instead of waiting until the timeout for a rank
  // that is alive but gone elsewhere (a two-level leader whose step between
  // hosts failed; NOTE: [Two-level collectives]).
  void abort();

  // The rooted forms the two-level path uses (NOTE: [Two-level collectives]
  // in two_level.cpp): only `root` reads, so the others do no work.
  // reduce: in place on `root`'s `flat`, in rank order as all_reduce (Avg
  // divides by the group size); the others' `flat` is left as it was.
  void reduce(at::Tensor& flat, ReduceOp op, int root);
  // gather: rank r's `flat` (numels[r] elements) into out[r] on `root`
  // only (`out` is ignored elsewhere).
  void gather(const at::Tensor& flat, const std::vector<int64_t>& numels, at::Tensor& out, int root);
  // scatter: `root`'s `flat` (sum(numels) elements; ignored elsewhere) split
  // into pieces of `numels`; returns this rank's piece.
  at::Tensor scatter(const at::Tensor& flat, const std::vector<int64_t>& numels, int root, const at::TensorOptions& options);

 private:
  ShmGroup(int rank, int size, void* base, size_t bytes, int64_t slot_bytes, std::chrono::milliseconds timeout);
  // The slot of `rank` in the buffer of collective `seq` (two buffers, alternating).
  uint8_t* slot(int rank, uint32_t seq) const;
  // Starts the next collective: `input` (if defined; contiguous, at most a
  // slot) into this rank's slot, then arrive_and_wait. Returns its number.
  uint32_t publish(const at::Tensor& input, uint64_t call);
  // Publishes this rank's arrival at `seq` with a hash of its `call`, then
  // waits for every member's; throws after the timeout, when a member's
  // process is gone, or when a member's call differs.
  void arrive_and_wait(uint32_t seq, uint64_t call);
  ShmRankLine& line(int rank) const;

  int rank_, size_;
  void* base_;
  size_t bytes_;
  int64_t slot_bytes_;
  std::chrono::milliseconds timeout_;
  uint32_t seq_ = 0;
};

}  // namespace dtp::detail
