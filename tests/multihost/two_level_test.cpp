// Two-level collectives (NOTE: [Two-level collectives] in
// src/comm/two_level.cpp) with ranks as threads of one process, each thread
// on a "host" of its own choosing (detail::HostKeyOverride): the layouts
// 2 x 2 (hosts {0,1} {2,3}), interleaved ({0,2} {1,3}), 3 + 1, and 3 x 2.
// Against a reference computed here in the path's order (host sums in rank
// order, then hosts in order), bit for bit, and against flat Gloo
// (DTP_TWO_LEVEL=0): exact where nothing rounds, else within the bound of two
// summation orders. Every call counts as one collective.
#include "../dist.h"

#include "comm/shm_group.h"
#include "dtp/comm_counter.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <cstdlib>
#include <limits>
#include <numeric>
#include <string>
#include <thread>

using namespace dtp;

namespace {

constexpr int64_t kSlot = 4096;  // bytes: 500 doubles take the path, 600 go flat through Gloo

using Results = std::vector<std::vector<at::Tensor>>;  // [rank][case]

struct Layout {
  const char* name;
  std::vector<int> host;  // per rank
};

// Runs `body` on one thread per rank of `layout`, each on its host, with
// DTP_TWO_LEVEL=`two_level` and 4 KiB slots; returns each rank's tensors and
// checks every call of `body` counted once (`calls` of them).
Results runOn(const Layout& layout, const char* two_level, int64_t calls, int* segments,
              const std::function<std::vector<at::Tensor>(const ProcessGroup&, int)>& body) {
  setenv("DTP_TWO_LEVEL", two_level, 1);
  setenv("DTP_SHM_MAX_BYTES", std::to_string(kSlot).c_str(), 1);
  const int w = static_cast<int>(layout.host.size());
  Results out(w);
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::seconds(60));
  std::vector<std::string> errors(w);
  std::vector<int64_t> counted(w);
  std::vector<std::thread> threads;
  std::atomic<int> made{0}, done{0};
  for (int r = 0; r < w; ++r)
    threads.emplace_back([&, r] {
      dtp::detail::HostKeyOverride host("host" + std::to_string(layout.host[r]));
      try {
        ProcessGroupOptions opts;
        opts.timeout = std::chrono::seconds(60);
        ProcessGroup g = ProcessGroup::create(store, r, w, opts);
        ++made;
        while (made < w) std::this_thread::yield();
        if (r == 0) *segments = dtp::test::mapped_shm_segments();
        CommCounter comm;
        out[r] = body(g, r);
        counted[r] = comm.total_count();
        ++done;
        while (done < w) std::this_thread::yield();  // no rank closes while another still talks
      } catch (const std::exception& e) {
        errors[r] = e.what();
        ++done;
      }
    });
  for (auto& t : threads) t.join();
  unsetenv("DTP_TWO_LEVEL");
  unsetenv("DTP_SHM_MAX_BYTES");
  for (int r = 0; r < w; ++r) {
    EXPECT_EQ(errors[r], "") << layout.name << ", rank " << r;
    EXPECT_EQ(counted[r], calls) << layout.name << ", rank " << r << ": each call must count as one collective";
  }
  return out;
}

at::Tensor input(int rank, int64_t numel, at::ScalarType dtype, int salt) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(1000 * salt + rank);
  if (dtype == at::kBool) return at::rand({numel}, g) > 0.5;
  if (!at::isFloatingType(dtype)) return at::randint(-1000, 1000, {numel}, g).to(dtype);
  return at::randn({numel}, g, at::kDouble).mul_(rank + 1).to(dtype);
}

// The path's order: each host's ranks in rank order, then the hosts' sums in
// host order (hosts numbered by their lowest rank).
at::Tensor hostOrder(const Layout& layout, const std::function<at::Tensor(int)>& x, ReduceOp op) {
  auto combine = [&](const at::Tensor& a, const at::Tensor& b) {
    return op == ReduceOp::Max ? at::maximum(a, b) : op == ReduceOp::Min ? at::minimum(a, b) : a + b;
  };
  std::vector<int> order;  // hosts by lowest rank
  for (int h : layout.host)
    if (std::find(order.begin(), order.end(), h) == order.end()) order.push_back(h);
  at::Tensor total;
  for (int h : order) {
    at::Tensor sum;
    for (size_t r = 0; r < layout.host.size(); ++r)
      if (layout.host[r] == h) sum = sum.defined() ? combine(sum, x(static_cast<int>(r))) : x(static_cast<int>(r)).clone();
    total = total.defined() ? combine(total, sum) : sum;
  }
  if (op == ReduceOp::Avg) total = total / static_cast<int64_t>(layout.host.size());
  return total;
}

// Two sums of the same W terms in other orders differ by at most
// 2 gamma_{W-1} sum |x_r| (gamma_k = k u / (1 - k u), u = eps / 2), plus one
// rounding of the result.
void expectWithinSumBound(const at::Tensor& a, const at::Tensor& b, const at::Tensor& mag, int w,
                          const std::string& what) {
  const double u = std::numeric_limits<double>::epsilon() / 2, k = w - 1;
  const at::Tensor bound = mag * (2 * k * u / (1 - k * u)) + b.abs() * u * 2;
  const at::Tensor diff = (a - b).abs();
  EXPECT_TRUE(diff.le(bound).all().item<bool>())
      << what << ": max |diff| " << diff.max().item<double>() << ", bound there " << bound.max().item<double>();
}

const std::vector<Layout>& layouts() {
  static const std::vector<Layout> l{{"2x2", {0, 0, 1, 1}},
                                     {"interleaved", {0, 1, 0, 1}},
                                     {"3+1", {0, 0, 1, 0}},
                                     {"3x2", {0, 0, 1, 1, 2, 2}}};
  return l;
}

class TwoLevelCollectives : public ::testing::TestWithParam<int> {};

// Sums in float64 (on the path and above the slot), max, min, avg, ints, bool.
TEST_P(TwoLevelCollectives, AllReduceInHostOrderAndWithinTheBoundOfFlatGloo) {
  const Layout& layout = layouts()[GetParam()];
  const int w = static_cast<int>(layout.host.size());
  struct C {
    at::ScalarType dtype;
    ReduceOp op;
    int64_t numel;
  };
  std::vector<C> cases;
  for (int64_t n : {int64_t{1}, int64_t{500}, int64_t{600}})
    for (auto op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) cases.push_back({at::kDouble, op, n});
  cases.push_back({at::kFloat, ReduceOp::Sum, 300});
  cases.push_back({at::kBFloat16, ReduceOp::Sum, 300});
  cases.push_back({at::kLong, ReduceOp::Sum, 100});
  cases.push_back({at::kBool, ReduceOp::Max, 100});
  auto body = [&](const ProcessGroup& g, int r) {
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < cases.size(); ++i) {
      at::Tensor t = input(r, cases[i].numel, cases[i].dtype, static_cast<int>(i));
      g.all_reduce(t, cases[i].op);
      out.push_back(t);
    }
    return out;
  };
  int two_segments = -1, flat_segments = -1;
  const Results two = runOn(layout, "1", static_cast<int64_t>(cases.size()), &two_segments, body);
  const Results flat = runOn(layout, "0", static_cast<int64_t>(cases.size()), &flat_segments, body);
  int hosts_with_two = 0;
  for (int h = 0; h < 3; ++h) hosts_with_two += std::count(layout.host.begin(), layout.host.end(), h) > 1;
  EXPECT_EQ(two_segments, hosts_with_two) << layout.name << ": one segment per host with two or more ranks";
  EXPECT_EQ(flat_segments, 0) << layout.name << ": DTP_TWO_LEVEL=0 maps none";
  const int hosts = *std::max_element(layout.host.begin(), layout.host.end()) + 1;
  for (size_t i = 0; i < cases.size(); ++i) {
    const C& c = cases[i];
    const std::string what = c10::str(layout.name, ": ", c10::toString(c.dtype), " ", to_string(c.op), " of ", c.numel);
    for (int r = 1; r < w; ++r) EXPECT_TRUE(at::equal(two[r][i], two[0][i])) << what << ": ranks 0 and " << r << " differ";
    const bool on_path = c.numel * (c.dtype == at::kBFloat16 ? 4 : c10::elementSize(c.dtype)) <= kSlot;
    const bool exact = !at::isFloatingType(c.dtype) || c.op == ReduceOp::Max || c.op == ReduceOp::Min;
    if (exact) {
      EXPECT_TRUE(at::equal(two[0][i], flat[0][i])) << what << ": differs from flat Gloo";
      continue;
    }
    if (c.dtype != at::kDouble) continue;
    auto x = [&](int r) { return input(r, c.numel, c.dtype, static_cast<int>(i)); };
    // 2 hosts: S_0 + S_1 is the leaders' Gloo sum whatever its order.
    if (on_path && hosts == 2)
      EXPECT_TRUE(at::equal(two[0][i], hostOrder(layout, x, c.op))) << what << ": not in host order, bit for bit";
    at::Tensor mag = at::zeros({c.numel}, at::kDouble);
    for (int r = 0; r < w; ++r) mag += x(r).abs();
    if (c.op == ReduceOp::Avg) mag /= w;
    expectWithinSumBound(two[0][i], flat[0][i], mag, w, what + " vs flat Gloo");
  }
}

// Uneven pieces (empty ones included) along dims 0 and 1: exactly the
// concatenation; the output exceeds a slot for the larger case.
TEST_P(TwoLevelCollectives, AllGatherUnevenIsTheConcatenation) {
  const Layout& layout = layouts()[GetParam()];
  const int w = static_cast<int>(layout.host.size());
  std::vector<int64_t> sizes;
  for (int r = 0; r < w; ++r) sizes.push_back(r % 3 == 1 ? 0 : 3 + r);
  struct G {
    at::ScalarType dtype;
    int64_t dim, other;
  };
  const std::vector<G> cases{{at::kDouble, 0, 7}, {at::kDouble, 1, 5}, {at::kBool, 0, 5}, {at::kBFloat16, 1, 3},
                             {at::kDouble, 0, 60}};  // 9 x 60 doubles = 4320 B a piece: flat
  auto shard = [&](const G& c, int r, int salt) {
    at::Tensor x = input(r, sizes[r] * c.other, c.dtype, salt).view({sizes[r], c.other});
    return c.dim == 0 ? x : x.t().contiguous();
  };
  auto body = [&](const ProcessGroup& g, int r) {
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < cases.size(); ++i)
      out.push_back(g.all_gather(shard(cases[i], r, static_cast<int>(i)), cases[i].dim, sizes).wait());
    return out;
  };
  int segments = 0;
  const Results two = runOn(layout, "1", static_cast<int64_t>(cases.size()), &segments, body);
  for (size_t i = 0; i < cases.size(); ++i) {
    std::vector<at::Tensor> pieces;
    for (int r = 0; r < w; ++r) pieces.push_back(shard(cases[i], r, static_cast<int>(i)));
    const at::Tensor want = at::cat(pieces, cases[i].dim);
    for (int r = 0; r < w; ++r) EXPECT_TRUE(at::equal(two[r][i], want)) << layout.name << ", case " << i << ", rank " << r;
  }
}

// Rank r gets piece r reduced over every rank: in host order (any number of
// hosts), and within the sum bound of flat Gloo.
TEST_P(TwoLevelCollectives, ReduceScatterUnevenInHostOrder) {
  const Layout& layout = layouts()[GetParam()];
  const int w = static_cast<int>(layout.host.size());
  std::vector<std::vector<int64_t>> size_sets{std::vector<int64_t>(w, 2), {}};
  for (int r = 0; r < w; ++r) size_sets[1].push_back(r == 1 ? 0 : r + 1);  // an empty piece
  if (layout.host == std::vector<int>{0, 0, 1, 1}) size_sets.push_back({2, 3, 0, 0});  // host 1 gets nothing
  struct C {
    ReduceOp op;
    int64_t cols;
  };
  const std::vector<C> ops{{ReduceOp::Sum, 7}, {ReduceOp::Avg, 7}, {ReduceOp::Max, 7}, {ReduceOp::Sum, 40}};
  auto full = [&](const std::vector<int64_t>& sizes, int64_t cols, int r, int salt) {
    const int64_t rows = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
    return input(r, rows * cols, at::kDouble, salt).view({rows, cols});
  };
  int64_t calls = 0;
  for (size_t s = 0; s < size_sets.size(); ++s) calls += static_cast<int64_t>(ops.size());
  auto body = [&](const ProcessGroup& g, int r) {
    std::vector<at::Tensor> out;
    for (size_t s = 0; s < size_sets.size(); ++s)
      for (size_t i = 0; i < ops.size(); ++i)
        out.push_back(g.reduce_scatter(full(size_sets[s], ops[i].cols, r, static_cast<int>(10 * s + i)), 0,
                                       size_sets[s], ops[i].op).wait());
    return out;
  };
  int segments = 0;
  const Results two = runOn(layout, "1", calls, &segments, body);
  const Results flat = runOn(layout, "0", calls, &segments, body);
  size_t k = 0;
  for (size_t s = 0; s < size_sets.size(); ++s)
    for (size_t i = 0; i < ops.size(); ++i, ++k) {
      const auto& sizes = size_sets[s];
      const int64_t rows = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
      const bool on_path = rows * ops[i].cols * 8 <= kSlot;
      int64_t offset = 0;
      for (int me = 0; me < w; ++me) {
        auto x = [&](int r) { return full(sizes, ops[i].cols, r, static_cast<int>(10 * s + i)).narrow(0, offset, sizes[me]); };
        const std::string what = c10::str(layout.name, ": ", to_string(ops[i].op), " with sizes ",
                                          c10::IntArrayRef(sizes), " x ", ops[i].cols, ", rank ", me);
        if (on_path) EXPECT_TRUE(at::equal(two[me][k], hostOrder(layout, x, ops[i].op))) << what << ": not in host order";
        at::Tensor mag = at::zeros({sizes[me], ops[i].cols}, at::kDouble);
        for (int r = 0; r < w; ++r) mag += x(r).abs();
        if (ops[i].op == ReduceOp::Avg) mag /= w;
        if (ops[i].op == ReduceOp::Max) EXPECT_TRUE(at::equal(two[me][k], flat[me][k])) << what;
        else expectWithinSumBound(two[me][k], flat[me][k], mag, w, what + " vs flat Gloo");
        offset += sizes[me];
      }
    }
}

// From every rank (a leader or not), and a barrier after each.
TEST_P(TwoLevelCollectives, BroadcastFromEveryRankAndBarrier) {
  const Layout& layout = layouts()[GetParam()];
  const int w = static_cast<int>(layout.host.size());
  auto body = [&](const ProcessGroup& g, int r) {
    std::vector<at::Tensor> out;
    for (int src = 0; src < w; ++src)
      for (auto dt : {at::kDouble, at::kBool, at::kBFloat16}) {
        at::Tensor t = input(r, 37, dt, src);
        g.broadcast(t, src);
        g.barrier();
        out.push_back(t);
      }
    return out;
  };
  int segments = 0;
  const Results two = runOn(layout, "1", 2 * 3 * w, &segments, body);
  size_t k = 0;
  for (int src = 0; src < w; ++src)
    for (auto dt : {at::kDouble, at::kBool, at::kBFloat16}) {
      const at::Tensor want = input(src, 37, dt, src);
      for (int r = 0; r < w; ++r)
        EXPECT_TRUE(at::equal(two[r][k], want)) << layout.name << ": " << c10::toString(dt) << " from " << src << ", rank " << r;
      ++k;
    }
}

INSTANTIATE_TEST_SUITE_P(Layouts, TwoLevelCollectives, ::testing::Range(0, 4), [](const auto& info) {
  const std::string n = layouts()[info.param].name;
  return n == "2x2" ? std::string("TwoByTwo") : n == "interleaved" ? std::string("Interleaved")
         : n == "3+1" ? std::string("ThreePlusOne") : std::string("ThreeByTwo");
});

// A member that failed inside a two-level collective (its leaders' step)
// marks itself failed: a member waiting for it fails at once, not after the
// timeout, though its process lives on.
TEST(TwoLevelFailure, AnAbortedMemberFailsTheOthersAtOnce) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::string msg;
  double waited = 0;
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      auto shm = dtp::detail::ShmGroup::connect(store, r, 2, std::chrono::seconds(60));
      ASSERT_TRUE(shm);
      if (r == 0) {
        shm->abort();
        return;
      }
      const auto start = std::chrono::steady_clock::now();
      msg = dtp::test::error_of([&] { shm->barrier(); });
      waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
  for (auto& t : ts) t.join();
  EXPECT_NE(msg.find("group rank 0 (pid"), std::string::npos) << msg;
  EXPECT_NE(msg.find("failed in an earlier step"), std::string::npos) << msg;
  EXPECT_LT(waited, 5.0) << "waited for the aborted member instead of failing at once";
}

TEST(TwoLevelSwitch, UnknownValueIsRefusedByName) {
  setenv("DTP_TWO_LEVEL", "yes", 1);
  std::string msg;
  std::vector<std::thread> ts;
  auto store = c10::make_intrusive<c10d::HashStore>();
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      dtp::detail::HostKeyOverride host("host" + std::to_string(r));
      const std::string m = dtp::test::error_of([&] { ProcessGroup::create(store, r, 2); });
      if (r == 0) msg = m;
    });
  for (auto& t : ts) t.join();
  unsetenv("DTP_TWO_LEVEL");
  EXPECT_NE(msg.find("DTP_TWO_LEVEL='yes'"), std::string::npos) << msg;
}

}  // namespace
