// Why a collective failed, in one line: the ranks that did not reach it
// and whether a peer closed its connection or nothing came in time.
#include "comm/agree.h"
#include "comm/error_text.h"
#include "comm/process_group_impl.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <chrono>
#include <cstdlib>
#include <future>
#include <memory>
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
//
// The store lives on rank 0's host. When the network to that host is down,
// a store request waits for the store's own timeout (DTP_TIMEOUT_S again),
// so the look happens on a thread of its own with copies of what it needs,
// and the failing rank waits for it at most kLookSeconds + 1 s: it then names
// the other members it could not ask about.
constexpr int kLookSeconds = 3;

std::string rankList(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "global rank " : "global ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

std::string whoDidNotArrive(const ProcessGroup::Impl& g, const std::string& key, const std::vector<int>& members) {
  std::vector<int> others;  // global ranks
  for (int r : members)
    if (r != g.rank) others.push_back(g.global_ranks[r]);
  const std::string unreachable =
      "the job's store (served by global rank 0) did not answer, so rank 0 exited or its host is unreachable; "
      "not known whether " + rankList(others) + " reached it";
  auto answer = std::make_shared<std::promise<std::string>>();
  auto future = answer->get_future();
  std::thread([answer, unreachable, store = g.root_store, prefix = g.prefix + "/dtp.arrived/" + key, rank = g.rank,
               global = g.global_ranks, members] {
    try {
      c10d::PrefixStore arrived(prefix, store);
      arrived.set(std::to_string(rank), std::vector<uint8_t>{1});
      std::vector<int> missing;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kLookSeconds);
      while (true) {
        missing.clear();
        for (int r : members)
          if (r != rank && !arrived.check({std::to_string(r)})) missing.push_back(global[r]);
        if (missing.empty() || std::chrono::steady_clock::now() > deadline) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      answer->set_value(missing.empty() ? (members.size() == 2 ? "both ends reached it" : "every member reached it")
                                        : rankList(missing) + " did not reach it");
    } catch (const std::exception&) {
      answer->set_value(unreachable);
    }
  }).detach();
  if (future.wait_for(std::chrono::seconds(kLookSeconds + 1)) != std::future_status::ready) return unreachable;
  return future.get();
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
  // NOTE: [A collective API names its first collective]
  if (const CollectiveCaller* caller = CollectiveCaller::current())
    fail(c10::str("dtp: ", caller->api(), " on global rank ", g.global_ranks[g.rank], ": its ", what, " #", n,
                  " on ranks of size-", g.size, " group failed: ", whoDidNotArrive(g, std::to_string(n), members),
                  "; ", reason(g, err), ". ", caller->api(), " is collective: ", caller->must(), ". A rank that did "
                  "not reach it took another code path (did not call ", caller->api(), "), exited, crashed or "
                  "hangs: check its output. [", err, "]"));
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
