// NOTE: [Result tape] A recording of the results (output tensors) of this
// thread's collectives (or, for the DTensor dispatcher, of the ops a save list
// names: selective AC's matrix products), in order, that can stand in for them
// later: while a tape records, every collective runs (synchronously) and its
// result is kept; while it replays, every collective returns the next kept
// result and communicates nothing.
// Selective activation checkpointing records the first pass of a
// checkpointed function and replays its recomputation, which issues the
// same collectives in the same order. TapeBypass lets collectives through
// untouched (fully_shard's parameter gathers, whose results must not be
// kept alive).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

namespace dtp::detail {

class ResultTape {
 public:
  ResultTape() = default;
  // A tape of DTensor op results (TapeKind::SavedOps) keeping the ops named
  // in `ops` ("aten::mm", ...).
  explicit ResultTape(std::vector<std::string> ops) : ops_(std::move(ops)) {}
  bool keeps(const std::string& op) const { return std::find(ops_.begin(), ops_.end(), op) != ops_.end(); }
  bool replaying() const { return replaying_; }
  void start_replay() {
    replaying_ = true;
    next_ = 0;
  }
  void push(at::Tensor result) { results_.push_back(std::move(result)); }
  // The next recorded result; an error when the replay asks for more than
  // was recorded (the function took another path the second time).
  const at::Tensor& pop();

 private:
  std::vector<std::string> ops_;
  std::deque<at::Tensor> results_;
  size_t next_ = 0;
  bool replaying_ = false;
};

enum class TapeKind : uint8_t { Collectives, SavedOps };

// The tape of this thread for `kind`, or null.
ResultTape* active_tape(TapeKind kind = TapeKind::Collectives);

// Makes `tape` this thread's tape of `kind` (null: none) for the scope's lifetime.
class TapeScope {
 public:
  explicit TapeScope(ResultTape* tape, TapeKind kind = TapeKind::Collectives);
  ~TapeScope();
  TapeScope(const TapeScope&) = delete;
  TapeScope& operator=(const TapeScope&) = delete;

 private:
  TapeKind kind_;
  ResultTape* prev_;
};

// No result tape of collectives inside this scope.
class TapeBypass : public TapeScope {
 public:
  TapeBypass() : TapeScope(nullptr) {}
};

}  // namespace dtp::detail
