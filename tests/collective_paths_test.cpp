// Every CPU path of a collective (Gloo, shared memory, two-level) goes
// through the one pipeline of NOTE: [Collective pipeline]
// (src/comm/collective_pipeline.h): under TORCH_DISTRIBUTED_DEBUG=DETAIL a
// call that differs between ranks (sizes, root or the collective itself) is
// named by NOTE: [Collective checks] before any path moves a byte, with the
// same message, word for word, on every path. 4 ranks as threads; the
// two-level layout puts them on two simulated hosts (HostKeyOverride).
#include "dist.h"

#include "comm/shm_group.h"
#include "dtp/comm_counter.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <numeric>
#include <string>
#include <thread>

using namespace dtp;

namespace {

constexpr int kW = 4;

struct Path {
  const char* name;
  const char* shm;        // DTP_SHM
  int host[kW];           // simulated host of each rank
};

// Runs `body` on kW ranks as threads, each on its host of `path`, under
// TORCH_DISTRIBUTED_DEBUG=DETAIL; returns what the ranks' errors said.
void runOn(const Path& path, const std::function<void(const ProcessGroup&, int)>& body) {
  setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL", 1);
  setenv("DTP_SHM", path.shm, 1);
  setenv("DTP_TWO_LEVEL", "1", 1);  // announces itself on stderr
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::seconds(60));
  std::vector<std::string> errors(kW);
  std::atomic<int> done{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < kW; ++r)
    threads.emplace_back([&, r] {
      dtp::detail::HostKeyOverride host("host" + std::to_string(path.host[r]));
      try {
        ProcessGroupOptions opts;
        opts.timeout = std::chrono::seconds(60);
        opts.backend = "gloo";
        ProcessGroup g = ProcessGroup::create(store, r, kW, opts);
        body(g, r);
        ++done;
        while (done < kW) std::this_thread::yield();  // no rank closes while another still talks
      } catch (const std::exception& e) {
        errors[r] = e.what();
        ++done;
      }
    });
  for (auto& t : threads) t.join();
  unsetenv("TORCH_DISTRIBUTED_DEBUG");
  unsetenv("DTP_SHM");
  unsetenv("DTP_TWO_LEVEL");
  for (int r = 0; r < kW; ++r) EXPECT_EQ(errors[r], "") << path.name << ", rank " << r;
}

// One mismatched call: rank 3 differs from the others.
struct Mismatch {
  const char* name;
  std::function<void(const ProcessGroup&, int)> call;
  std::vector<std::string> parts;  // in every rank's message
};

std::vector<Mismatch> mismatches() {
  auto f64 = [](int64_t n) { return at::ones({n}, at::kDouble); };
  return {
      {"all_reduce sizes",
       [=](const ProcessGroup& g, int r) { g.all_reduce(f64(r == 3 ? 6 : 4)); },
       {"global rank 0: all_reduce(sum) of Double[4]", "global rank 3: all_reduce(sum) of Double[6]"}},
      {"all_gather sizes",
       [=](const ProcessGroup& g, int r) {
         const int64_t n = r == 3 ? 2 : 1;
         g.all_gather(f64(n), 0, std::vector<int64_t>(kW, n));
       },
       {"global rank 0: all_gather of Double[1] along dim 0 with sizes [1, 1, 1, 1]",
        "global rank 3: all_gather of Double[2] along dim 0 with sizes [2, 2, 2, 2]"}},
      {"reduce_scatter sizes",
       [=](const ProcessGroup& g, int r) {
         const int64_t n = r == 3 ? 2 : 1;
         g.reduce_scatter(f64(kW * n), 0, std::vector<int64_t>(kW, n));
       },
       {"global rank 0: reduce_scatter of Double[4] along dim 0 with sizes [1, 1, 1, 1]",
        "global rank 3: reduce_scatter of Double[8] along dim 0 with sizes [2, 2, 2, 2]"}},
      {"broadcast root",
       [=](const ProcessGroup& g, int r) { g.broadcast(f64(4), r == 3 ? 1 : 0); },
       {"global rank 0: broadcast of Double[4] from rank 0", "global rank 3: broadcast of Double[4] from rank 1"}},
      {"a different collective",
       [=](const ProcessGroup& g, int r) {
         if (r == 3)
           g.all_gather(f64(4), 0, std::vector<int64_t>(kW, 4));
         else
           g.all_reduce(f64(4));
       },
       {"global rank 0: all_reduce(sum) of Double[4]",
        "global rank 3: all_gather of Double[4] along dim 0 with sizes [4, 4, 4, 4]"}},
      {"barrier against all_reduce",
       [=](const ProcessGroup& g, int r) {
         if (r == 3)
           g.barrier();
         else
           g.all_reduce(f64(4));
       },
       {"global rank 0: all_reduce(sum) of Double[4]", "global rank 3: barrier"}},
      {"all_to_all_single splits",
       [=](const ProcessGroup& g, int r) {
         const std::vector<int64_t> send(kW, 1), recv(kW, r == 3 ? 2 : 1);
         g.all_to_all_single(f64(kW), recv, send);
       },
       {"global rank 0: all_to_all_single of Double[4] on rank 0: send [1, 1, 1, 1] rows, receive [1, 1, 1, 1]",
        "global rank 3: all_to_all_single of Double[4] on rank 3: send [1, 1, 1, 1] rows, receive [2, 2, 2, 2]"}},
  };
}

TEST(CollectivePaths, MismatchNamedAlikeOnGlooSharedMemoryAndTwoLevel) {
  const std::vector<Path> paths{{"Gloo", "0", {0, 0, 0, 0}},
                                {"shared memory", "1", {0, 0, 0, 0}},
                                {"two-level", "1", {0, 0, 1, 1}}};
  const std::vector<Mismatch> cases = mismatches();
  std::map<std::string, std::vector<std::string>> said;  // path -> case -> rank 0's message
  for (const Path& path : paths) {
    std::vector<std::vector<std::string>> msgs(cases.size(), std::vector<std::string>(kW));
    int segments = -1;
    testing::internal::CaptureStderr();
    runOn(path, [&](const ProcessGroup& g, int r) {
      for (size_t c = 0; c < cases.size(); ++c) msgs[c][r] = test::error_of([&] { cases[c].call(g, r); });
      // The checks pass a correct program, which then runs on the path: a
      // float64 sum and reduce_scatter equal to the reference.
      CommCounter comm;
      at::Tensor sum = g.all_reduce(at::full({3}, double(r + 1), at::kDouble)).wait();
      EXPECT_EQ(sum.equal(at::full({3}, 10.0, at::kDouble)), true) << path.name << ": " << sum;
      at::Tensor in = at::arange(kW * 2, at::kDouble).mul_(r + 1);
      at::Tensor mine = g.reduce_scatter(in, 0, std::vector<int64_t>(kW, 2)).wait();
      EXPECT_EQ(mine.equal(at::arange(kW * 2, at::kDouble).mul_(10).narrow(0, 2 * r, 2)), true)
          << path.name << ": " << mine;
      EXPECT_EQ(comm.total_count(), 2) << path.name << ": the checks are not counted";
      if (r == 0) segments = dtp::test::mapped_shm_segments();
    });
    const std::string err = testing::internal::GetCapturedStderr();
    // The path each layout takes: Gloo maps no segment; two-level says so.
    EXPECT_EQ(segments > 0, std::string(path.shm) == "1") << path.name;
    EXPECT_EQ(err.find("dtp: two-level collectives") != std::string::npos, path.host[3] == 1) << path.name << err;
    for (size_t c = 0; c < cases.size(); ++c) {
      for (int r = 0; r < kW; ++r) {
        const std::string& m = msgs[c][r];
        EXPECT_NE(m.find("dtp: the ranks of a size-4 group disagree on collective #1 (caught by "
                         "TORCH_DISTRIBUTED_DEBUG=DETAIL)"),
                  std::string::npos)
            << path.name << ", " << cases[c].name << ", rank " << r << ": " << m;
        for (const auto& part : cases[c].parts)
          EXPECT_NE(m.find(part), std::string::npos) << path.name << ", " << cases[c].name << ": " << m;
        EXPECT_EQ(m, msgs[c][0]) << path.name << ", " << cases[c].name << ": every rank says the same";
      }
      said[path.name].push_back(msgs[c][0]);
    }
  }
  for (size_t c = 0; c < cases.size(); ++c) {
    EXPECT_EQ(said["shared memory"][c], said["Gloo"][c]) << cases[c].name;
    EXPECT_EQ(said["two-level"][c], said["Gloo"][c]) << cases[c].name;
  }
}

}  // namespace

namespace {

// Rank r sends (r + q) % 3 rows to rank q (some none), 3 float64 per row.
int64_t rowsFrom(int r, int q) { return (r + q) % 3; }

// Each rank's all_to_all_single result with DTP_SHM=`shm` and `slot`-byte slots.
std::vector<at::Tensor> allToAllSingleWith(int w, const char* shm, int64_t slot, int64_t row_scale) {
  setenv("DTP_SHM", shm, 1);
  setenv("DTP_SHM_MAX_BYTES", std::to_string(slot).c_str(), 1);
  std::vector<at::Tensor> out(w);
  test::run_ranks(w, [&](int r) {
    std::vector<int64_t> send, recv;
    for (int q = 0; q < w; ++q) {
      send.push_back(rowsFrom(r, q) * row_scale);
      recv.push_back(rowsFrom(q, r) * row_scale);
    }
    const int64_t rows = std::accumulate(send.begin(), send.end(), int64_t{0});
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(7 + r);
    at::Tensor in = at::randn({rows, 3}, g, at::kDouble).add_(100 * r);
    CommCounter comm;
    out[r] = default_process_group().all_to_all_single(in, recv, send).wait();
    EXPECT_EQ(comm.count(CollectiveType::AllToAll), 1) << "DTP_SHM=" << shm;
  });
  unsetenv("DTP_SHM");
  unsetenv("DTP_SHM_MAX_BYTES");
  return out;
}

// NOTE: [Shared-memory all_to_all]: uneven and empty splits through shared
// memory equal Gloo's exchange bit for bit; with 4 KiB slots the larger
// exchange is declined on every rank and Gloo carries it.
TEST(CollectivePaths, AllToAllSingleSharedMemoryEqualsGloo) {
  for (int w : {2, 4}) {
    for (int64_t scale : {int64_t{1}, int64_t{100}}) {  // 100: over a 4 KiB slot
      const auto shm = allToAllSingleWith(w, "1", 4096, scale);
      const auto gloo = allToAllSingleWith(w, "0", 4096, scale);
      for (int r = 0; r < w; ++r) {
        int64_t rows = 0;
        for (int q = 0; q < w; ++q) rows += rowsFrom(q, r) * scale;
        EXPECT_EQ(shm[r].sizes(), at::IntArrayRef({rows, 3})) << w << " ranks, rank " << r;
        EXPECT_TRUE(shm[r].equal(gloo[r])) << w << " ranks, rank " << r << ", scale " << scale << ": max |diff| "
                                           << (shm[r] - gloo[r]).abs().max().item<double>();
      }
    }
  }
}

}  // namespace
