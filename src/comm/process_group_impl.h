// The state behind a dtp::ProcessGroup handle, shared by the files of src/comm.
#pragma once

#include "comm/compat.h"
#include "comm/shm_group.h"
#include "dtp/process_group.h"

#include <exception>
#include <map>
#include <mutex>
#include <tuple>
#include <string>

namespace dtp {

namespace detail {
class LocalPath;
class ProgressThread;
class TwoLevel;
}

struct ProcessGroup::Impl {
  c10::intrusive_ptr<compat::Backend> backend;       // Gloo, for CPU tensors; null for a group of one
  c10::intrusive_ptr<compat::Backend> cuda_backend;  // NCCL, for CUDA tensors; null without NCCL
  bool nccl = false;                                 // NOTE: [Backends per device]
  std::shared_ptr<detail::ShmGroup> shm;             // small CPU collectives on one host; null: Gloo only
  std::shared_ptr<detail::TwoLevel> two_level;       // across hosts: NOTE: [Two-level collectives]; null: Gloo only
  detail::LocalPath* local_path = nullptr;           // shm or two_level, whichever is set; null: c10d only
  c10::intrusive_ptr<c10d::Store> root_store;
  std::string prefix;  // store prefix of this group, unique in the job
  int rank = 0;
  int size = 1;
  std::vector<int> global_ranks;
  ProcessGroupOptions options;
  std::string backend_name;
  mutable int64_t next_group_id = 0;
  mutable int64_t collectives = 0;  // issued on this group, the same count on every member
  // Point-to-point messages per (source, destination, tag), counted alike by
  // both ends: the n-th send from a to b with tag t matches b's n-th recv.
  mutable std::map<std::tuple<int, int, int>, int64_t> p2p_messages;
  // Runs async collectives of the in-memory path; made at the first one.
  // Last: it ends (running what is queued) before the paths it uses.
  // NOTE: [Async collectives on a LocalPath] in progress_thread.h.
  std::shared_ptr<detail::ProgressThread> progress;
};

// The backend that carries `t`: Gloo for CPU tensors, NCCL for CUDA ones
// (a named error when the group has none).
compat::Backend& backend_for(const ProcessGroup::Impl& g, const at::Tensor& t);

// NOTE: [One Gloo call at a time] c10d records every Gloo collective in a
// process-wide flight recorder (on by default in recent releases, 2000
// entries, TORCH_FR_BUFFER_SIZE; off in 2.6), whose first record of each group inserts into a
// std::map before taking its lock. Two threads issuing their groups' first
// collectives at once (ranks as threads in tests, an async checkpoint's group
// beside training's) corrupt that map: segfaults in
// FlightRecorder::recordWithResetEnabled on the torch 2.11 wheel. dtp issues
// every Gloo call under one process-wide mutex; issuing only enqueues (the
// wait happens outside it), so it costs an uncontended lock per collective.
// NCCL calls are not serialized: their first call may block in communicator
// set-up until the peers arrive, and dtp issues them from one thread.
std::mutex& gloo_issue_mutex();

// Issues `call(backend)` on the backend that carries `t`, under
// gloo_issue_mutex() for Gloo; without a tensor (barrier), on Gloo.
template <class Call>
auto issue_on_backend(const ProcessGroup::Impl& g, const at::Tensor& t, Call&& call) {
  compat::Backend& backend = t.defined() ? backend_for(g, t) : *g.backend;
  if (t.defined() && t.is_cuda()) return call(backend);
  std::lock_guard<std::mutex> lock(gloo_issue_mutex());
  return call(backend);
}

// `t` as a dtype Gloo carries. Gloo has no bool type, and libtorch 1.13's
// Gloo no bfloat16: such tensors travel as their bytes (bool: one byte, 0 or
// 1; bfloat16: two, as Half, which Gloo only copies), which every collective
// that only moves data keeps valid. Sums of bfloat16 are widened first.
inline at::Tensor as_gloo_dtype(const at::Tensor& t) {
  if (t.scalar_type() == at::kBool) return t.view(at::kByte);
  if (t.scalar_type() == at::kBFloat16) return t.view(at::kHalf);
  return t;
}

// Throws the one-line error of a failed collective: `what` #n (the group's
// collective count) on `g`, the ranks that did not reach it and why.
// See NOTE: [Who did not arrive] in collective_failure.cpp.
[[noreturn]] void explain_failure(const ProcessGroup::Impl& g, const std::string& what, int64_t n,
                                  const std::exception& e);
// The same for point-to-point message `n` between group ranks `src` and
// `dst` with `tag`: whether the peer reached it.
[[noreturn]] void explain_p2p_failure(const ProcessGroup::Impl& g, const std::string& what, int src, int dst,
                                      int tag, int64_t n, const std::exception& e);

}  // namespace dtp
