// The state behind a dtp::ProcessGroup handle, shared by the files of src/comm.
#pragma once

#include "comm/compat.h"
#include "comm/shm_group.h"
#include "dtp/process_group.h"

#include <exception>
#include <string>

namespace dtp {

struct ProcessGroup::Impl {
  c10::intrusive_ptr<compat::Backend> backend;       // Gloo, for CPU tensors; null for a group of one
  c10::intrusive_ptr<compat::Backend> cuda_backend;  // NCCL, for CUDA tensors; null without NCCL
  bool nccl = false;                                 // NOTE: [Backends per device]
  std::shared_ptr<detail::ShmGroup> shm;             // small CPU collectives on one host; null: Gloo only
  c10::intrusive_ptr<c10d::Store> root_store;
  std::string prefix;  // store prefix of this group, unique in the job
  int rank = 0;
  int size = 1;
  std::vector<int> global_ranks;
  ProcessGroupOptions options;
  std::string backend_name;
  mutable int64_t next_group_id = 0;
  mutable int64_t collectives = 0;  // issued on this group, the same count on every member
};

// Throws the one-line error of a failed collective: `what` #n (the group's
// collective count) on `g`, the ranks that did not reach it and why.
// See NOTE: [Who did not arrive] in collective_failure.cpp.
[[noreturn]] void explain_failure(const ProcessGroup::Impl& g, const std::string& what, int64_t n,
                                  const std::exception& e);

}  // namespace dtp
