// redistribute(..., async_op=true) (NOTE: [Async redistribution]): values
// equal to the synchronous path's and to one device in float64, on 1-D and
// (2,2) meshes, even and uneven shapes, one- and multi-step plans; the same
// collectives counted; the call returns before a held-back peer has joined
// (Gloo, shared memory, two-level); a collective that fails throws at the
// first use, naming it; the backward and the TP styles (async inputs, as
// PyTorch's) unchanged.
#include "dist.h"

#include "comm/shm_group.h"
#include "dtensor/dtensor_impl.h"
#include "dtensor/redistribute.h"
#include "dtp/comm_counter.h"
#include "dtp/device_mesh.h"
#include "dtp/dtensor.h"
#include "dtp/nn/modules.h"
#include "dtp/tp/parallelize.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>

using namespace dtp;
using dtp::test::run_ranks;

namespace {

// Which CPU path carries the collectives: the shared-memory path (ranks of
// one host, messages up to DTP_SHM_MAX_BYTES) or Gloo alone (DTP_SHM=0).
enum class CpuPath { Shm, Gloo };

// Sets DTP_SHM for the groups made in its scope.
class PathScope {
 public:
  explicit PathScope(CpuPath p) {
    if (p == CpuPath::Gloo) setenv("DTP_SHM", "0", 1);
  }
  ~PathScope() { unsetenv("DTP_SHM"); }
};

double maxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  return a.numel() == 0 ? 0.0 : (a - b).abs().max().item<double>();
}

// The same full tensor on every rank (seeded), float64.
at::Tensor fullOf(const std::vector<int64_t>& shape, int64_t seed) {
  return at::arange(c10::multiply_integers(shape), at::kDouble).reshape(shape).mul(0.37).add(seed).sin();
}

bool isPending(const at::Tensor& t) { return unsafeGetDTensorImpl(t)->pending(); }

int64_t collectivesIn(const DTensorSpec& spec, const Placements& dst) {
  int64_t n = 0;
  for (const auto& s : plan_redistribute(spec, dst)) n += s.collective.has_value();
  return n;
}

struct Case {
  Placements src, dst;
};

struct Param {
  std::vector<int64_t> mesh;
  CpuPath path;
};

class AsyncRedistributeTest : public ::testing::TestWithParam<Param> {};
// 2 ranks, on each path.
class AsyncRedistributePathTest : public ::testing::TestWithParam<CpuPath> {};
// When the issuing rank gets its handle, and what it throws at use. Not
// under TORCH_DISTRIBUTED_DEBUG=DETAIL (hence a name outside the filter of
// the ctest CollectiveChecksAcceptCorrectPrograms): there each collective is
// first checked by a synchronous one (NOTE: [Collective checks]), so the
// issuing rank waits for its peers, as PyTorch's ProcessGroupWrapper does.
bool detailChecks() {
  const char* debug = std::getenv("TORCH_DISTRIBUTED_DEBUG");
  return debug != nullptr && std::string(debug) == "DETAIL";
}
constexpr const char* kDetailSkip = "TORCH_DISTRIBUTED_DEBUG=DETAIL checks each collective synchronously at its issue";
class AsyncIssueTest : public ::testing::TestWithParam<CpuPath> {
 protected:
  void SetUp() override {
    if (detailChecks()) GTEST_SKIP() << kDetailSkip;
  }
};

// Every case on every shape: the async result is pending right after the
// call exactly when its plan communicates, then equals the synchronous
// result bit for bit (same collectives, same order of sums) and one device's
// tensor exactly (float64; a Partial source is the value on coordinate 0 and
// zeros elsewhere, so its sums add zeros: exact); the counts are the sync
// path's.
TEST_P(AsyncRedistributeTest, ValuesAndCountsEqualTheSyncPath) {
  const Param p = GetParam();
  const PathScope scope(p.path);
  int world = 1;
  for (int64_t s : p.mesh) world *= static_cast<int>(s);
  std::vector<Case> cases;
  if (p.mesh.size() == 1) {
    cases = {{{Shard(0)}, {Replicate()}},  {{Shard(1)}, {Replicate()}},    {{Shard(0)}, {Shard(1)}},
             {{Partial()}, {Replicate()}}, {{Partial()}, {Shard(0)}},      {{Partial()}, {Shard(1)}},
             {{Replicate()}, {Shard(0)}},  {{Partial()}, {Partial(ReduceOp::Max)}}};
  } else {
    cases = {{{Shard(0), Shard(1)}, {Replicate(), Replicate()}},
             {{Shard(0), Shard(0)}, {Replicate(), Shard(0)}},  // gathers twice, then a local chunk after the last
             {{Shard(0), Replicate()}, {Replicate(), Shard(0)}},
             {{Partial(), Shard(0)}, {Replicate(), Replicate()}},
             {{Replicate(), Partial()}, {Shard(1), Replicate()}},
             {{Shard(0), Shard(1)}, {Shard(1), Shard(0)}}};
  }
  // 4k, 4k+1, 4k+3 rows, and fewer rows than ranks.
  const std::vector<std::vector<int64_t>> shapes = {{8, 12}, {9, 6}, {11, 5}, {3, 7}};
  run_ranks(world, [&](int) {
    const DeviceMesh mesh = init_device_mesh("cpu", p.mesh);
    int64_t seed = 0;
    for (const auto& shape : shapes) {
      for (const auto& c : cases) {
        const at::Tensor full = fullOf(shape, ++seed);
        const at::Tensor x = distribute_tensor(full, mesh, c.src);
        const std::string what = dtensor_spec(x).str() + " -> " + to_string(c.dst);
        CommCounter sync_count;
        const at::Tensor sync = redistribute(x, mesh, c.dst);
        const auto sync_str = sync_count.str();
        CommCounter async_count;
        const at::Tensor y = redistribute(x, mesh, c.dst, /*async_op=*/true);
        EXPECT_EQ(isPending(y), collectivesIn(dtensor_spec(x), c.dst) > 0) << what;
        EXPECT_EQ(placements(y), c.dst) << what;
        EXPECT_EQ(y.sizes(), full.sizes()) << what;
        const at::Tensor mine = to_local(y);  // waits here
        EXPECT_FALSE(isPending(y)) << what;
        EXPECT_EQ(async_count.str(), sync_str) << what;
        EXPECT_EQ(mine.sizes(), to_local(sync).sizes()) << what;
        EXPECT_TRUE(mine.equal(to_local(sync))) << what << ": differs from the sync path by "
                                               << maxAbsDiff(mine, to_local(sync));
        EXPECT_EQ(maxAbsDiff(full_tensor(y), full), 0.0) << what;
      }
    }
  });
}

// Ops, full_tensor and a further redistribution each wait for a pending
// DTensor themselves (not only to_local), and aliases (detach) share one wait.
TEST_P(AsyncRedistributePathTest, EveryUseWaitsFirst) {
  const PathScope scope(GetParam());
  run_ranks(2, [&](int) {
    const DeviceMesh mesh = init_device_mesh("cpu", {2});
    const at::Tensor full = fullOf({9, 4}, 1);
    const at::Tensor x = distribute_tensor(full, mesh, {Shard(0)});
    // An op on it.
    at::Tensor y = redistribute(x, mesh, {Replicate()}, /*async_op=*/true);
    ASSERT_TRUE(isPending(y));
    EXPECT_EQ(maxAbsDiff(to_local(at::mul(y, 2.0)), full * 2), 0.0);
    EXPECT_FALSE(isPending(y));
    // full_tensor.
    y = redistribute(x, mesh, {Replicate()}, /*async_op=*/true);
    EXPECT_EQ(maxAbsDiff(full_tensor(y), full), 0.0);
    // A redistribution of it: S(0) -> R (async) -> S(1).
    y = redistribute(x, mesh, {Replicate()}, /*async_op=*/true);
    at::Tensor z = redistribute(y, mesh, {Shard(1)});
    EXPECT_FALSE(isPending(y));
    EXPECT_EQ(maxAbsDiff(full_tensor(z), full), 0.0);
    // An alias: the detached copy waits, the original then has its shard.
    y = redistribute(x, mesh, {Replicate()}, /*async_op=*/true);
    const at::Tensor alias = detached_alias(y);
    EXPECT_TRUE(isPending(alias));
    EXPECT_EQ(maxAbsDiff(to_local(alias), full), 0.0);
    EXPECT_EQ(maxAbsDiff(to_local(y), full), 0.0);
  });
}

// The backward of an async redistribution (synchronous) gives the sync
// path's gradient, with the same collectives.
TEST_P(AsyncRedistributeTest, BackwardEqualsTheSyncPath) {
  const Param p = GetParam();
  const PathScope scope(p.path);
  int world = 1;
  for (int64_t s : p.mesh) world *= static_cast<int>(s);
  run_ranks(world, [&](int) {
    const DeviceMesh mesh = init_device_mesh("cpu", p.mesh);
    const at::Tensor full = fullOf({9, 6}, 3);
    const Placements src(p.mesh.size(), Shard(0));
    const Placements dst(p.mesh.size(), Replicate());
    at::Tensor grads[2];
    std::string counts[2];
    for (int async_op = 0; async_op < 2; ++async_op) {
      at::Tensor x = distribute_tensor(full.clone().requires_grad_(true), mesh, src);
      at::Tensor y = redistribute(x, mesh, dst, async_op == 1);
      CommCounter backward;
      (y * y).sum().backward();
      counts[async_op] = backward.str();
      grads[async_op] = full_tensor(x.grad());
    }
    EXPECT_TRUE(grads[1].equal(grads[0])) << maxAbsDiff(grads[1], grads[0]);
    EXPECT_EQ(counts[1], counts[0]);
    EXPECT_EQ(maxAbsDiff(grads[1], full * 2), 0.0);  // d(sum y^2)/dy = 2y, exact in float64
  });
}

// The call returns with its collective still running: the peer does not
// join until the issuing rank has its result handle. A synchronous call
// would block until the peer gives up waiting (20 s) and joins, and
// `joined` would then read true.
TEST_P(AsyncIssueTest, ReturnsBeforeThePeerJoins) {
  const PathScope scope(GetParam());
  std::atomic<bool> issued{false}, joined{false};
  run_ranks(2, [&](int rank) {
    const DeviceMesh mesh = init_device_mesh("cpu", {2});
    const at::Tensor full = fullOf({6, 4}, 5);
    const at::Tensor x = distribute_tensor(full, mesh, {Shard(0)});
    if (rank == 1) {
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (!issued && std::chrono::steady_clock::now() < give_up)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      joined = true;
    }
    const at::Tensor y = redistribute(x, mesh, {Replicate()}, /*async_op=*/true);
    if (rank == 0) {
      EXPECT_FALSE(joined) << "redistribute(async_op=true) waited for its collective";
      EXPECT_TRUE(isPending(y));
      issued = true;
    }
    EXPECT_EQ(maxAbsDiff(to_local(y), full), 0.0);
  });
}

// A peer that never joins: the async call returns, and the first use throws
// the collective's failure with the redistribution's name; later uses throw
// it again.
TEST_P(AsyncIssueTest, FailedCollectiveSurfacesAtFirstUse) {
  const PathScope scope(GetParam());
  std::atomic<bool> reported{false};
  run_ranks(2, [&](int rank) {
    const DeviceMesh mesh = init_device_mesh("cpu", {2});
    const at::Tensor x = distribute_tensor(fullOf({8, 4}, 7), mesh, {Shard(0)});
    if (rank == 1) {  // alive, but never redistributes
      while (!reported) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      return;
    }
    at::Tensor y;
    ASSERT_NO_THROW(y = redistribute(x, mesh, {Replicate()}, /*async_op=*/true));
    const std::vector<std::string> parts = {"dtp: redistribute f64[8,4](S(0)) -> (R) with async_op=true failed",
                                            "all_gather #", "global rank 1 did not reach it"};
    dtp::test::expect_error([&] { (void)at::add(y, 1.0); }, parts);
    dtp::test::expect_error([&] { (void)to_local(y); }, parts);
    reported = true;
  }, std::chrono::seconds(2));
}

// The TP styles redistribute their inputs and outputs with async_op=true, as
// PyTorch's: a Colwise -> Rowwise MLP under sequence sharding (input
// S(0) -> R all_gather, output P -> S(0) reduce_scatter) gives the same
// outputs, gradients and collectives as with every redistribution
// synchronous (SyncRedistributeScope), and one device's values in float64.
TEST_P(AsyncRedistributePathTest, StylesMatchTheSyncPath) {
  const PathScope scope(GetParam());
  const int w = 2;
  run_ranks(w, [&](int rank) {
    const DeviceMesh mesh = init_device_mesh("cpu", {w});
    const int64_t rows = 4 * w;  // Colwise infers the global rows of a plain input from even shards
    const at::Tensor full_in = fullOf({rows, 6}, 11);
    auto build = [&] {
      dtp::nn::Linear a(6, 4 * w), b(4 * w, 6);
      torch::NoGradGuard no_grad;
      a->weight.copy_(fullOf({4 * w, 6}, 12));
      a->bias.copy_(fullOf({4 * w}, 13));
      b->weight.copy_(fullOf({6, 4 * w}, 14));
      b->bias.copy_(fullOf({6}, 15));
      a->to(at::kDouble);
      b->to(at::kDouble);
      return std::make_pair(a, b);
    };
    auto [ref_a, ref_b] = build();
    at::Tensor ref_x = full_in.clone().requires_grad_(true);
    at::Tensor ref_y = ref_b(at::relu(ref_a(ref_x)));
    (ref_y * ref_y).sum().backward();

    at::Tensor out[2], in_grad[2], w_grad[2];
    std::string fwd[2], bwd[2];
    for (int async_op = 1; async_op >= 0; --async_op) {
      auto [a, b] = build();
      parallelize_module(*a, mesh, ColwiseParallel(ColwiseParallelOptions().input_layouts(Shard(0))));
      parallelize_module(*b, mesh,
                         RowwiseParallel(RowwiseParallelOptions().output_layouts(Shard(0)).use_local_output(false)));
      std::optional<SyncRedistributeScope> sync;
      if (async_op == 0) sync.emplace();
      const int64_t start = chunk_start(rows, w, rank), len = chunk_size(rows, w, rank);
      at::Tensor x = full_in.narrow(0, start, len).clone().requires_grad_(true);
      CommCounter f;
      at::Tensor y = b(a(x).relu());
      fwd[async_op] = f.str();
      CommCounter g;
      (y * y).sum().backward();
      bwd[async_op] = g.str();
      out[async_op] = full_tensor(y);
      in_grad[async_op] = x.grad();
      w_grad[async_op] = full_tensor(a->weight.grad());
      EXPECT_LE(maxAbsDiff(in_grad[async_op], ref_x.grad().narrow(0, start, len)), 1e-12)
          << "input gradient vs one device";
    }
    EXPECT_EQ(fwd[1], fwd[0]);
    EXPECT_EQ(bwd[1], bwd[0]);
    EXPECT_TRUE(out[1].equal(out[0])) << maxAbsDiff(out[1], out[0]);
    EXPECT_TRUE(in_grad[1].equal(in_grad[0])) << maxAbsDiff(in_grad[1], in_grad[0]);
    EXPECT_TRUE(w_grad[1].equal(w_grad[0])) << maxAbsDiff(w_grad[1], w_grad[0]);
    // float64 against one device: the sharded sums regroup the same terms,
    // |terms| < 50, so rounding stays below 1e-12.
    EXPECT_LE(maxAbsDiff(out[1], ref_y), 1e-12);
    EXPECT_LE(maxAbsDiff(w_grad[1], ref_a->weight.grad()), 1e-12);
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, AsyncRedistributeTest,
                         ::testing::Values(Param{{2}, CpuPath::Shm}, Param{{4}, CpuPath::Shm},
                                           Param{{2, 2}, CpuPath::Shm}, Param{{2}, CpuPath::Gloo},
                                           Param{{4}, CpuPath::Gloo}, Param{{2, 2}, CpuPath::Gloo}),
                         [](const auto& info) {
                           std::string s = info.param.path == CpuPath::Shm ? "shm" : "gloo";
                           for (int64_t d : info.param.mesh) s += "_" + std::to_string(d);
                           return s;
                         });

INSTANTIATE_TEST_SUITE_P(Paths, AsyncRedistributePathTest, ::testing::Values(CpuPath::Shm, CpuPath::Gloo),
                         [](const auto& info) { return info.param == CpuPath::Shm ? "shm" : "gloo"; });
INSTANTIATE_TEST_SUITE_P(Paths, AsyncIssueTest, ::testing::Values(CpuPath::Shm, CpuPath::Gloo),
                         [](const auto& info) { return info.param == CpuPath::Shm ? "shm" : "gloo"; });

// The two-level path (ranks on two simulated hosts) runs an async
// collective on the group's progress thread too: all_reduce returns before
// the held-back rank 3 joins, and gives the sum.
TEST(AsyncCollectivesTest, TwoLevelReturnsBeforeThePeerJoins) {
  if (detailChecks()) GTEST_SKIP() << kDetailSkip;
  constexpr int kW = 4;
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::seconds(60));
  std::atomic<bool> issued{false}, joined{false};
  std::atomic<int> done{0};
  std::vector<std::string> errors(kW);
  std::vector<std::thread> threads;
  for (int r = 0; r < kW; ++r)
    threads.emplace_back([&, r] {
      const dtp::detail::HostKeyOverride host("host" + std::to_string(r / 2));
      try {
        ProcessGroupOptions opts;
        opts.timeout = std::chrono::seconds(60);
        opts.backend = "gloo";
        const ProcessGroup g = ProcessGroup::create(store, r, kW, opts);
        if (r == 3) {
          const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
          while (!issued && std::chrono::steady_clock::now() < give_up)
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
          joined = true;
        }
        Work work = g.all_reduce(at::full({5}, static_cast<double>(r + 1), at::kDouble), ReduceOp::Sum,
                                 /*async_op=*/true);
        if (r == 0) {
          if (joined) errors[r] = "all_reduce(async_op=true) on the two-level path waited for its collective";
          issued = true;
        }
        const at::Tensor sum = work.wait();
        if (!sum.equal(at::full({5}, 10.0, at::kDouble))) errors[r] += " wrong sum " + c10::str(sum);
        ++done;
        while (done < kW) std::this_thread::yield();  // no rank closes while another still talks
      } catch (const std::exception& e) {
        errors[r] = e.what();
        ++done;
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < kW; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

}  // namespace
