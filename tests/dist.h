// Runs a test body on W ranks as W threads of this process. Each rank gets its
// own process group (Gloo; with backend "auto" also NCCL for CUDA tensors on
// an NCCL build) over a shared in-memory HashStore, installed as the thread's
// default group, so dtp code runs exactly as in a real job.
#pragma once

#include "dtp/process_group.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <unistd.h>

#include <condition_variable>
#include <fstream>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace dtp::test {

inline void run_ranks(int world_size, const std::function<void(int rank)>& body,
                      std::chrono::seconds timeout = std::chrono::seconds(60), const std::string& backend = "gloo") {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(timeout);
  std::mutex mu;
  std::condition_variable all_done;
  int finished = 0;
  std::vector<std::string> errors;
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      try {
        ProcessGroupOptions opts;
        opts.backend = backend;
        opts.timeout = timeout;
        set_default_process_group(ProcessGroup::create(store, r, world_size, opts));
        body(r);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back("rank " + std::to_string(r) + ": " + e.what());
      }
      // No rank closes its connections while another may still use them
      // (a rank whose body ends at once would otherwise close them while a
      // peer's group creation is still completing its handshake).
      {
        std::unique_lock<std::mutex> lock(mu);
        ++finished;
        all_done.notify_all();
        all_done.wait(lock, [&] { return finished == world_size; });
      }
      set_default_process_group(ProcessGroup());
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) ADD_FAILURE() << e;
}

// The dtp shared-memory segments this process maps (NOTE: [Shared-memory
// collectives]): a group with a shared-memory or two-level path maps one,
// once per rank of its host; Gloo alone none.
inline int mapped_shm_segments() {
  std::ifstream maps("/proc/self/maps");
  std::set<std::string> names;
  const std::string prefix = "/dev/shm/dtp-" + std::to_string(getpid()) + "-";
  for (std::string line; std::getline(maps, line);)
    if (const auto at = line.find(prefix); at != std::string::npos) names.insert(line.substr(at, prefix.size() + 16));
  return static_cast<int>(names.size());
}

// Sizes of torch.chunk(n, parts): ceil-div, trailing parts short or empty.
inline std::vector<int64_t> chunk_sizes(int64_t n, int64_t parts) {
  const int64_t per = (n + parts - 1) / parts;
  std::vector<int64_t> s;
  for (int64_t p = 0; p < parts; ++p) s.push_back(std::max<int64_t>(0, std::min(per, n - p * per)));
  return s;
}

// The message (without backtrace) of the c10::Error `f` throws, or "<no error>".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

// Expects `f` to throw a c10::Error whose message contains every part.
inline void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  const std::string msg = error_of(f);
  for (const auto& part : parts) EXPECT_NE(msg.find(part), std::string::npos) << msg;
}
inline void expect_error(const std::function<void()>& f, const char* part) { expect_error(f, std::vector<std::string>{part}); }

}  // namespace dtp::test
