// Why a collective failed, in one line: the ranks that did not reach it
// and whether a peer closed its connection or nothing came in time.
#include "comm/error_text.h"
#include "comm/process_group_impl.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <chrono>
#include <cstdlib>
#include <thread>
#include <vector>

namespace dtp {

namespace {

// NOTE: [Who did not arrive] When a collective fails, each member that was
// in it records so in the job's store (under the group's prefix and the
// collective's number, which every member counts alike) and looks, for a few
// seconds, for the others' records: a member that never records did not
// reach the collective (it exited, crashed, hangs or took another code path).
// Nothing is written while collectives succeed. A point-to-point message is
// the same between its two ends, under the message's own number (per source,
// destination and tag).
std::string whoDidNotArrive(const ProcessGroup::Impl& g, const std::string& key, const std::vector<int>& members) {
  try {
    c10d::PrefixStore store(g.prefix + "/dtp.arrived/" + key, g.root_store);
    store.set(std::to_string(g.rank), std::vector<uint8_t>{1});
    std::vector<int> missing;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    while (true) {
      missing.clear();
      for (int r : members)
        if (r != g.rank && !store.check({std::to_string(r)})) missing.push_back(g.global_ranks[r]);
      if (missing.empty() || std::chrono::steady_clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (missing.empty()) return members.size() == 2 ? "both ends reached it" : "every member reached it";
    std::string s = missing.size() == 1 ? "global rank " : "global ranks ";
    for (size_t i = 0; i < missing.size(); ++i) s += (i ? ", " : "") + std::to_string(missing[i]);
    return s + " did not reach it";
  } catch (const std::exception&) {
    return "the job's store (served by global rank 0) is unreachable, so rank 0 has probably exited";
  }
}

// Why the backend failed, from its error text.
std::string reason(const ProcessGroup::Impl& g, const std::string& err) {
  const bool closed = err.find("Connection closed") != std::string::npos ||
                      err.find("Connection reset") != std::string::npos ||
                      err.find("Broken pipe") != std::string::npos;
  const bool timed_out = err.find("imed out") != std::string::npos || err.find("imeout") != std::string::npos;
  const std::string timeout = std::to_string(g.options.timeout.count() / 1000);
  return closed      ? "a peer closed its connection (it exited, crashed, or gave up after DTP_TIMEOUT_S=" + timeout + " s)"
         : timed_out ? "nothing came within DTP_TIMEOUT_S=" + timeout + " s"
                     : std::string("the backend failed");
}

[[noreturn]] void fail(std::string msg) {
  const char* show = std::getenv("TORCH_SHOW_CPP_STACKTRACES");
  TORCH_CHECK(show == nullptr || std::string(show) != "1", msg);
  throw compat::error_without_backtrace(std::move(msg));
}

}  // namespace

[[noreturn]] void explain_failure(const ProcessGroup::Impl& g, const std::string& what, int64_t n,
                                  const std::exception& e) {
  const std::string err = error_text(e);
  std::vector<int> members(g.size);
  for (int r = 0; r < g.size; ++r) members[r] = r;
  fail(c10::str("dtp: ", what, " #", n, " on ranks of size-", g.size, " group (global rank ",
                g.global_ranks[g.rank], ") failed: ", whoDidNotArrive(g, std::to_string(n), members), "; ",
                reason(g, err), ". A rank that did not reach it exited, crashed, hangs or took another code path: "
                "check its output. [", err, "]"));
}

[[noreturn]] void explain_p2p_failure(const ProcessGroup::Impl& g, const std::string& what, int src, int dst,
                                      int tag, int64_t n, const std::exception& e) {
  const std::string err = error_text(e);
  const int peer = g.rank == src ? dst : src;
  fail(c10::str("dtp: ", what, " of message #", n, " from global rank ", g.global_ranks[src], " to global rank ",
                g.global_ranks[dst], " (tag ", tag, ") failed on global rank ", g.global_ranks[g.rank], ": ",
                whoDidNotArrive(g, c10::str("p2p/", src, "-", dst, "/", tag, "/", n), {src, dst}), "; ",
                reason(g, err), ". If global rank ", g.global_ranks[peer], " did not reach it, it exited, crashed, "
                "hangs or took another code path: check its output; if both did, their sends and recvs do not "
                "match (peer, tag, order, or the receiving tensor's size). [", err, "]"));
}

}  // namespace dtp
