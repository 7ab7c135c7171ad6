// Collectives of a group that spans hosts, in two levels: shared memory among
// the group's ranks on each host, Gloo among one leader per host. See NOTE:
// [Two-level collectives] in two_level.cpp.
#pragma once

#include "comm/compat.h"
#include "comm/local_path.h"
#include "comm/shm_group.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace dtp::detail {

// DTP_TWO_LEVEL: "0" (off: groups that span hosts use Gloo alone), "auto"
// (the default: on for every group that spans hosts with two or more of its
// ranks on some host), "1" (the same, and group rank 0 of each group that
// takes the path says so on stderr). Anything else is an error naming the
// variable.
bool two_level_enabled();
bool two_level_announced();

class TwoLevel final : public LocalPath {
 public:
  // Every member calls it (through `store`, the group's own prefix), after
  // ShmGroup::connect said the members are not all on one host. Null on
  // every member where the group does not span two or more hosts with two or
  // more of its ranks on one of them, where any member has DTP_TWO_LEVEL=0
  // or DTP_SHM=0, or where a host's segment cannot be made. `gloo` are the
  // options (devices, timeout) of the group's own Gloo backend.
  static std::shared_ptr<TwoLevel> connect(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                           const c10::intrusive_ptr<c10d::ProcessGroupGloo::Options>& gloo,
                                           std::chrono::milliseconds timeout);

  int hosts() const { return static_cast<int>(members_.size()); }
  // The leaders' group ranks, host by host.
  std::vector<int> leaders() const {
    std::vector<int> l;
    for (const auto& m : members_) l.push_back(m.front());
    return l;
  }
  // The largest message the path takes, as ShmGroup::max_bytes(): bytes each
  // rank puts in (all_reduce, reduce_scatter: its whole input; all_gather:
  // the largest piece; broadcast: the tensor).
  int64_t max_bytes() const override { return slot_bytes_; }

  // As ShmGroup's, over the whole group (group ranks).
  void all_reduce(at::Tensor& flat, ReduceOp op) override;
  void all_gather(const at::Tensor& flat, const std::vector<int64_t>& numels, at::Tensor& out) override;
  at::Tensor reduce_scatter(const at::Tensor& flat, const std::vector<int64_t>& numels, ReduceOp op) override;
  // NYI on two levels: declines (on every member), so c10d carries it.
  bool all_to_all(const at::Tensor&, const std::vector<int64_t>&, const std::vector<int64_t>&, at::Tensor&) override {
    return false;
  }
  void broadcast(at::Tensor& flat, int src) override;
  void barrier() override;

 private:
  TwoLevel() = default;
  // Around each collective: on an exception, aborts this rank's line of the
  // host segment (see the NOTE's "Failures").
  class Guard {
   public:
    explicit Guard(TwoLevel& self) : self_(self), entered_(std::uncaught_exceptions()) {}
    ~Guard();

   private:
    TwoLevel& self_;
    int entered_;
  };
  bool leader() const { return local_rank_ == 0; }
  // Waits for a leaders' Gloo call issued under gloo_issue_mutex().
  template <class Call>
  void onLeaders(Call&& call);
  // Within this host, from local rank `root`: `flat` of any size, in slot-sized pieces.
  void localBroadcast(at::Tensor& flat, int root);

  std::shared_ptr<ShmGroup> local_;                  // this host's members, in group-rank order; null for one
  c10::intrusive_ptr<c10d::ProcessGroupGloo> leaders_;  // rank h = host h's leader; null off leaders
  std::vector<std::vector<int>> members_;            // host -> its group ranks, ascending
  std::vector<int> host_of_, local_of_;              // group rank -> host, -> local rank
  int rank_ = 0, size_ = 1, host_ = 0, local_rank_ = 0;
  int64_t slot_bytes_ = 0;
};

}  // namespace dtp::detail
