// A group's progress thread: runs its asynchronous in-memory collectives
// (shared memory, two-level) in the order issued. See NOTE: [Async
// collectives on a LocalPath].
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace dtp::detail {

// NOTE: [Async collectives on a LocalPath]
// The in-memory paths are synchronous: a rank copies into its slot and waits
// for its peers on the thread that calls. With async_op, the pipeline
// (NOTE: [Collective pipeline]) hands such a collective to its group's
// progress thread (one per group, started at its first async collective) and
// returns a Work that waits for it; Gloo and NCCL are asynchronous already
// (c10d's worker thread, a CUDA stream) and keep their own path.
// Order: every rank must run a group's collectives in one order (the
// shared-memory path numbers them). The progress thread takes them in the
// order issued, and a collective the calling thread runs on the in-memory
// path itself first waits until the queue is empty (drain), so none
// overtakes an earlier one. Gloo orders its collectives as they are issued,
// on the calling thread; the two channels do not wait on each other, so a
// queued in-memory collective and a later Gloo one of the same group cannot
// deadlock.
// all_to_all_single stays synchronous on the in-memory path: the path decides
// in a first round whether it carries the exchange, and one it declines goes
// to Gloo, which must be issued in program order on the calling thread.
class ProgressThread {
 public:
  ProgressThread() : thread_([this] { loop(); }) {}
  // Runs what is queued, then ends the thread.
  ~ProgressThread() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;

  // Queues `task` (which catches its own errors) behind the others.
  void submit(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(task));
      ++unfinished_;
    }
    wake_.notify_all();
  }
  // Returns when every task submitted so far has run.
  void drain() {
    std::unique_lock<std::mutex> lock(mu_);
    idle_.wait(lock, [&] { return unfinished_ == 0; });
  }

 private:
  void loop() {
    while (true) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, nothing left
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
      {
        std::lock_guard<std::mutex> lock(mu_);
        --unfinished_;
      }
      idle_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_, idle_;
  std::deque<std::function<void()>> queue_;
  int64_t unfinished_ = 0;  // queued or running
  bool stop_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace dtp::detail
