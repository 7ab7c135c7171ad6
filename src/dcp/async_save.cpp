#include "dtp/dcp/checkpoint.h"

#include "dcp/exchange.h"
#include "dcp/save_plan.h"

#include <ATen/ATen.h>

#include <iostream>
#include <numeric>

namespace dtp::dcp {

AsyncSaver::AsyncSaver(std::optional<ProcessGroup> group) {
  group_ = checkpoint_group(group);
  if (group_ && group_->size() > 1) {
    // A group of its own: the writer thread's collectives never interleave
    // with those the training issues meanwhile.
    std::vector<int> ranks(group_->size());
    std::iota(ranks.begin(), ranks.end(), 0);
    group_ = group_->new_group(ranks);
  }
}

AsyncSaver::~AsyncSaver() {
  try {
    wait();
  } catch (const std::exception& e) {
    std::cerr << "dtp: AsyncSaver: the last checkpoint save failed (the previous checkpoint is unchanged): "
              << e.what() << std::endl;
  }
}

void AsyncSaver::save(const StateDict& state_dict, const std::string& dir) {
  wait();
  agree_on_value(group_, "AsyncSaver::save", "folders", dir);
  TORCH_CHECK(!dir.empty(), "AsyncSaver::save: no folder given (dir is \"\"). Name the checkpoint's folder, e.g. "
              "\"ckpt/step-100\".");
  SavePlan plan;
  agree(group_, error_of([&] { plan = plan_save(state_dict); }),
        "async save of '" + dir + "'");
  // The snapshot: training may change the live tensors as soon as we return.
  for (auto& piece : plan.pieces) piece.data = piece.data.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
  pending_ = std::async(std::launch::async, [plan = std::move(plan), dir, group = group_]() mutable {
    write_plan(std::move(plan), dir, group);
  });
}

void AsyncSaver::wait() {
  if (!pending_.valid()) return;
  std::future<void> done = std::move(pending_);
  done.get();
}

bool AsyncSaver::in_flight() const {
  return pending_.valid() && pending_.wait_for(std::chrono::seconds(0)) != std::future_status::ready;
}

}  // namespace dtp::dcp
