// The shard of a DTensor that an asynchronous redistribution still computes
// (PyTorch's AsyncCollectiveTensor). See NOTE: [Async redistribution] in
// redistribute.cpp.
#pragma once

#include "dtp/dtensor_spec.h"
#include "dtp/process_group.h"

#include <ATen/core/Tensor.h>

#include <exception>
#include <functional>
#include <memory>
#include <mutex>

namespace dtp {

using SpecPtr = std::shared_ptr<const DTensorSpec>;

class PendingLocal {
 public:
  // `work`: the redistribution's last collective; `finish`: the local steps
  // after it, applied to its result. `like` has the shard's dtype and device,
  // and its layout (strides' order) when `like_layout`, else the shard is
  // contiguous. `src` and `dst` name the redistribution in errors.
  PendingLocal(Work work, std::function<at::Tensor(at::Tensor)> finish, at::Tensor like, bool like_layout,
               SpecPtr src, Placements dst)
      : work_(std::move(work)),
        finish_(std::move(finish)),
        like_(std::move(like)),
        like_layout_(like_layout),
        src_(std::move(src)),
        dst_(std::move(dst)) {}

  // The shard: waits for the collective and runs the local steps the first
  // time; a failure is thrown then and at every later call, naming the
  // redistribution and (from the collective) what failed.
  const at::Tensor& get();

  const at::Tensor& like() const { return like_; }
  bool like_layout() const { return like_layout_; }

 private:
  std::mutex mu_;  // autograd's threads may use a DTensor too
  Work work_;
  std::function<at::Tensor(at::Tensor)> finish_;
  at::Tensor like_, result_;
  bool like_layout_, done_ = false;
  std::exception_ptr error_;
  SpecPtr src_;
  Placements dst_;
};

}  // namespace dtp
