#include "comm/two_level.h"

#include "comm/process_group_impl.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <numeric>

// NOTE: [Two-level collectives]
// A group whose ranks sit on several hosts cannot share one segment (NOTE:
// [Shared-memory collectives]); flat, its collectives go through Gloo, every
// rank a peer of every other over the network. Two-level instead:
//
//   1. within each host, through that host's segment: the host's members'
//      inputs reduced (or gathered) to its leader, the member of lowest
//      group rank;
//   2. between the leaders, one per host, over Gloo;
//   3. within each host again: the leader's result broadcast (or scattered)
//      to the host's members.
//
// 2 x 2 ranks, hosts {0, 1} and {2, 3}: an all_reduce crosses the network
// once per host (leaders 0 and 2, each sending its host's sum), where flat
// Gloo's ring of 4 crosses it on 2 of its 4 links in each of its 6 steps.
//
// Which ranks share a host comes from host_key() (hostname, boot id, the
// /dev/shm in use), exchanged through the group's store when the group is
// made; hosts are numbered by their lowest group rank. Chosen per group, on
// every member alike: a group on one host keeps the flat segment, a group
// with one rank per host gains nothing and keeps Gloo.
//
// Order of a sum (also Avg, divided by the group size at the leaders):
//   - all_reduce: each host's members in group-rank order (the segment's
//     reduce), then the hosts' sums by Gloo's allreduce among the leaders.
//     With 2 hosts that is S_0 + S_1 exactly (addition commutes); with more,
//     Gloo's ring adds the hosts' sums in an order that depends on the
//     element's chunk. Every rank gets the same bits (the leaders' result
//     is broadcast).
//   - reduce_scatter: host sums as above, then each leader adds the hosts'
//     sums of its members' pieces in host order 0, 1, ...: for any number
//     of hosts, (S_0 + S_1) + S_2 + ...
// Flat Gloo sums in another order (its ring's, per chunk), and the flat
// segment of one host in rank order. Any two orders of summing n numbers
// x_i differ by at most 2 * gamma_{n-1} * sum |x_i|, gamma_k = k u / (1 - k u),
// u = 2^-53 in float64 (Higham, Accuracy and Stability, 4.2): 2 x 2 ranks,
// at most ~6u sum |x_i|. Max, min, gathers and broadcasts are exact.
//
// Sizes: the path takes what the flat segment would (each rank's input up to
// its slot, DTP_SHM_MAX_BYTES); an all_gather's output, which may exceed a
// slot, is broadcast within each host in slot-sized pieces. Larger messages
// go through Gloo flat. The leaders' Gloo is a backend of its own (leaders
// only), made with the group's devices and timeout.
//
// Failures: a leader's Gloo call fails as the flat path's would (a peer
// closed, or DTP_TIMEOUT_S). A rank that fails inside a two-level collective
// marks itself failed in its host's segment (ShmGroup::abort) before the
// error leaves, so the host's other members, waiting for it there, fail at
// once: its process lives on (an asynchronous checkpoint's thread failed, the
// main thread waits in another group), so they would otherwise wait for
// DTP_TIMEOUT_S (found by MultiHost.RestartAfterLostRankResumesLikeUninterrupted:
// 1 run in 5 hung until the test's timeout before this).

namespace dtp::detail {

namespace {

c10d::ReduceOp glooOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: return c10d::ReduceOp::SUM;
    case ReduceOp::Max: return c10d::ReduceOp::MAX;
    case ReduceOp::Min: return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

// Avg is a sum until the leaders divide.
ReduceOp summing(ReduceOp op) { return op == ReduceOp::Avg ? ReduceOp::Sum : op; }

std::string getText(c10d::Store& store, const std::string& key) {
  const auto v = store.get(key);
  return std::string(v.begin(), v.end());
}

void setText(c10d::Store& store, const std::string& key, const std::string& value) {
  store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

}  // namespace

bool two_level_announced() {
  const char* v = std::getenv("DTP_TWO_LEVEL");
  return v != nullptr && std::string(v) == "1";
}

bool two_level_enabled() {
  const char* v = std::getenv("DTP_TWO_LEVEL");
  if (v == nullptr || *v == '\0') return true;
  const std::string s(v);
  TORCH_CHECK(s == "0" || s == "1" || s == "auto", "dtp: DTP_TWO_LEVEL='", s,
              "': got an unknown value, expected 0, 1 or auto. Unset it for the default (auto).");
  return s != "0";
}

std::shared_ptr<TwoLevel> TwoLevel::connect(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                            const c10::intrusive_ptr<c10d::ProcessGroupGloo::Options>& gloo,
                                            std::chrono::milliseconds timeout) {
  const char* shm = std::getenv("DTP_SHM");
  const bool on = two_level_enabled() && !(shm != nullptr && std::string(shm) == "0");
  setText(*store, "tl/host/" + std::to_string(rank), (on ? "1 " : "0 ") + host_key());
  std::vector<std::string> keys;
  bool all_on = true;
  std::vector<int> host_of(size);
  for (int r = 0; r < size; ++r) {
    const std::string got = getText(*store, "tl/host/" + std::to_string(r));
    all_on = all_on && got.rfind("1 ", 0) == 0;
    const std::string key = got.substr(2);
    auto it = std::find(keys.begin(), keys.end(), key);
    host_of[r] = static_cast<int>(it - keys.begin());
    if (it == keys.end()) keys.push_back(key);
  }
  const int hosts = static_cast<int>(keys.size());
  if (!all_on || hosts < 2 || hosts == size) return nullptr;

  std::shared_ptr<TwoLevel> t(new TwoLevel());
  t->rank_ = rank;
  t->size_ = size;
  t->members_.resize(hosts);
  t->host_of_ = host_of;
  t->local_of_.resize(size);
  for (int r = 0; r < size; ++r) {
    t->local_of_[r] = static_cast<int>(t->members_[host_of[r]].size());
    t->members_[host_of[r]].push_back(r);
  }
  t->host_ = host_of[rank];
  t->local_rank_ = t->local_of_[rank];
  const int local_size = static_cast<int>(t->members_[t->host_].size());
  bool ok = true;
  if (local_size > 1) {
    auto local_store = c10::make_intrusive<c10d::PrefixStore>("tl/h" + std::to_string(t->host_), store);
    t->local_ = ShmGroup::connect(local_store, t->local_rank_, local_size, timeout);
    ok = t->local_ != nullptr;
  }
  // Every member decides alike: on only where every host made its segment.
  store->set("tl/ok/" + std::to_string(rank), std::vector<uint8_t>{static_cast<uint8_t>(ok)});
  for (int r = 0; r < size; ++r) ok = store->get("tl/ok/" + std::to_string(r)).at(0) == 1 && ok;
  if (!ok) return nullptr;
  if (t->leader())
    t->leaders_ = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("tl/leaders", store), t->host_, hosts, gloo);
  t->slot_bytes_ = shm_max_bytes();
  return t;
}

TwoLevel::Guard::~Guard() {
  // Unwinding from a failure (a leader's Gloo step, a wait that timed out):
  // this host's other members must not wait for this rank any longer.
  if (std::uncaught_exceptions() > entered_ && self_.local_) self_.local_->abort();
}

template <class Call>
void TwoLevel::onLeaders(Call&& call) {
  c10::intrusive_ptr<c10d::Work> work;
  {
    std::lock_guard<std::mutex> lock(gloo_issue_mutex());  // NOTE: [One Gloo call at a time]
    work = call(*leaders_);
  }
  work->wait();
}

void TwoLevel::localBroadcast(at::Tensor& flat, int root) {
  if (!local_) return;
  const int64_t per = std::max<int64_t>(slot_bytes_ / flat.element_size(), 1);
  for (int64_t at = 0; at < flat.numel(); at += per) {
    at::Tensor piece = flat.narrow(0, at, std::min(per, flat.numel() - at));
    local_->broadcast(piece, root);
  }
}

void TwoLevel::all_reduce(at::Tensor& flat, ReduceOp op) {
  const Guard guard(*this);
  if (local_) local_->reduce(flat, summing(op), 0);
  if (leader()) {
    onLeaders([&](c10d::ProcessGroupGloo& b) {
      std::vector<at::Tensor> bufs{as_gloo_dtype(flat)};
      c10d::AllreduceOptions opts;
      opts.reduceOp = glooOp(op);
      return b.allreduce(bufs, opts);
    });
    if (op == ReduceOp::Avg) flat.div_(size_);
  }
  localBroadcast(flat, 0);
}

void TwoLevel::all_gather(const at::Tensor& flat, const std::vector<int64_t>& numels, at::Tensor& out) {
  const Guard guard(*this);
  const int H = hosts();
  std::vector<int64_t> blob(H, 0), local_numels;
  for (int r = 0; r < size_; ++r) blob[host_of_[r]] += numels[r];
  for (int r : members_[host_]) local_numels.push_back(numels[r]);
  const int64_t widest = *std::max_element(blob.begin(), blob.end());
  if (leader()) {
    // This host's pieces in group-rank order, padded to the widest host's.
    at::Tensor mine = at::empty({widest}, flat.options());
    at::Tensor filled = mine.narrow(0, 0, blob[host_]);
    if (local_) local_->gather(flat, local_numels, filled, 0);
    else filled.copy_(flat);
    mine.narrow(0, blob[host_], widest - blob[host_]).zero_();
    at::Tensor all = at::empty({H, widest}, flat.options());
    onLeaders([&](c10d::ProcessGroupGloo& b) {
      std::vector<std::vector<at::Tensor>> outs(1);
      for (int h = 0; h < H; ++h) outs[0].push_back(as_gloo_dtype(all[h]));
      std::vector<at::Tensor> ins{as_gloo_dtype(mine)};
      return b.allgather(outs, ins);
    });
    // Into group-rank order: rank r is piece local_of_[r] of host host_of_[r].
    std::vector<int64_t> within(H, 0);
    int64_t pos = 0;
    for (int r = 0; r < size_; ++r) {
      const int h = host_of_[r];
      if (numels[r] > 0) out.narrow(0, pos, numels[r]).copy_(all[h].narrow(0, within[h], numels[r]));
      within[h] += numels[r];
      pos += numels[r];
    }
  } else {
    at::Tensor unused;
    local_->gather(flat, local_numels, unused, 0);
  }
  localBroadcast(out, 0);
}

at::Tensor TwoLevel::reduce_scatter(const at::Tensor& flat, const std::vector<int64_t>& numels, ReduceOp op) {
  const Guard guard(*this);
  const int H = hosts();
  std::vector<int64_t> offset(size_ + 1, 0), blob(H, 0), local_numels;
  for (int r = 0; r < size_; ++r) {
    offset[r + 1] = offset[r] + numels[r];
    blob[host_of_[r]] += numels[r];
  }
  for (int r : members_[host_]) local_numels.push_back(numels[r]);
  at::Tensor reduced;  // on the leader: this host's members' pieces, reduced over every rank
  if (leader()) {
    at::Tensor acc = flat.clone();  // reduce is in place; `flat` may be the caller's input
    if (local_) local_->reduce(acc, summing(op), 0);
    const bool empty_host = std::find(blob.begin(), blob.end(), 0) != blob.end();
    if (empty_host) {
      // Gloo fails on empty buffers (NOTE: [Zero-size collectives]): all hosts' sums whole, then this host's pieces.
      onLeaders([&](c10d::ProcessGroupGloo& b) {
        std::vector<at::Tensor> bufs{as_gloo_dtype(acc)};
        c10d::AllreduceOptions opts;
        opts.reduceOp = glooOp(op);
        return b.allreduce(bufs, opts);
      });
      std::vector<at::Tensor> mine;
      for (int r : members_[host_]) mine.push_back(acc.narrow(0, offset[r], numels[r]));
      reduced = at::cat(mine);
    } else {
      // Host h' gets its members' pieces of this host's sum, in its rank order.
      std::vector<at::Tensor> send;
      std::vector<int64_t> in_counts(blob), out_counts(H, blob[host_]);
      for (int h = 0; h < H; ++h)
        for (int r : members_[h]) send.push_back(acc.narrow(0, offset[r], numels[r]));
      at::Tensor in = at::cat(send);
      at::Tensor recv = at::empty({H * blob[host_]}, flat.options());
      onLeaders([&](c10d::ProcessGroupGloo& b) {
        at::Tensor recv_wire = as_gloo_dtype(recv), in_wire = as_gloo_dtype(in);
        return b.alltoall_base(recv_wire, in_wire, out_counts, in_counts);
      });
      // The hosts' sums in host order 0, 1, ...
      at::Tensor parts = recv.view({H, blob[host_]});
      reduced = parts[0].clone();
      for (int h = 1; h < H; ++h) {
        switch (summing(op)) {
          case ReduceOp::Max: at::maximum_out(reduced, reduced, parts[h]); break;
          case ReduceOp::Min: at::minimum_out(reduced, reduced, parts[h]); break;
          default: reduced.add_(parts[h]);
        }
      }
    }
    if (op == ReduceOp::Avg) reduced.div_(size_);
  } else {
    at::Tensor in = flat;
    local_->reduce(in, summing(op), 0);  // not written off the root
  }
  if (!local_) return reduced;
  return local_->scatter(reduced, local_numels, 0, flat.options());
}

void TwoLevel::broadcast(at::Tensor& flat, int src) {
  const Guard guard(*this);
  const int from = host_of_[src];
  if (host_ == from && local_) local_->broadcast(flat, local_of_[src]);  // the source's host, its leader included
  if (leader())
    onLeaders([&](c10d::ProcessGroupGloo& b) {
      std::vector<at::Tensor> bufs{as_gloo_dtype(flat)};
      c10d::BroadcastOptions opts;
      opts.rootRank = from;
      return b.broadcast(bufs, opts);
    });
  if (host_ != from && local_) local_->broadcast(flat, 0);
}

void TwoLevel::barrier() {
  const Guard guard(*this);
  if (local_) local_->barrier();
  if (leader()) onLeaders([](c10d::ProcessGroupGloo& b) { return b.barrier(); });
  if (local_) local_->barrier();
}

}  // namespace dtp::detail
