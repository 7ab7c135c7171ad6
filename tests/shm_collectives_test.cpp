// The shared-memory path for CPU collectives of ranks on one host (NOTE:
// [Shared-memory collectives] in src/comm/shm_group.cpp) against a reduction
// in rank order computed here (bit for bit), and against Gloo alone
// (DTP_SHM=0): exact where no rounding happens, else within the bound of two
// summation orders. Slots are 4 KiB here (DTP_SHM_MAX_BYTES), so the same
// cases cover sizes below the limit (shared memory) and above it (Gloo).
#include "close.h"
#include "dist.h"

#include "comm/shm_group.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <limits>
#include <numeric>
#include <string>
#include <unistd.h>

using namespace dtp;
using dtp::test::run_ranks;

namespace {

constexpr int64_t kSlot = 4096;  // bytes: 1000 floats go through shared memory, 3000 through Gloo

using Results = std::vector<std::vector<at::Tensor>>;  // [rank][case]

// Runs `body` on W ranks as threads with the path set by `shm` ("0": Gloo
// alone) and 4 KiB slots; returns each rank's tensors.
Results runWith(int w, const char* shm, const std::function<std::vector<at::Tensor>(const ProcessGroup&, int)>& body) {
  setenv("DTP_SHM", shm, 1);
  setenv("DTP_SHM_MAX_BYTES", std::to_string(kSlot).c_str(), 1);
  Results out(w);
  run_ranks(w, [&](int r) { out[r] = body(default_process_group(), r); });
  unsetenv("DTP_SHM");
  unsetenv("DTP_SHM_MAX_BYTES");
  return out;
}

// Rank r's input of `numel` elements of `dtype`: random, inexact sums for floats.
at::Tensor input(int rank, int64_t numel, at::ScalarType dtype, int salt) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(1000 * salt + rank);
  if (dtype == at::kBool) return at::rand({numel}, g) > 0.5;
  if (dtype == at::kByte) return at::randint(0, 60, {numel}, g).to(dtype);
  if (!at::isFloatingType(dtype)) return at::randint(-1000, 1000, {numel}, g).to(dtype);
  return at::randn({numel}, g, at::kDouble).mul_(rank + 1).to(dtype);
}

struct Case {
  at::ScalarType dtype;
  ReduceOp op;
  int64_t numel;
};

std::vector<Case> allReduceCases() {
  std::vector<Case> cases;
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{5}, int64_t{1000}, int64_t{3000}}) {
    for (auto dt : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16})
      for (auto op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) cases.push_back({dt, op, n});
    for (auto dt : {at::kInt, at::kLong, at::kByte})
      for (auto op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min}) cases.push_back({dt, op, n});
    for (auto op : {ReduceOp::Max, ReduceOp::Min}) cases.push_back({at::kBool, op, n});
  }
  return cases;
}

// The reduction of every rank's input in rank order, as the shared-memory
// path computes it: half and bfloat16 in float32, rounded once.
at::Tensor rankOrder(int w, const Case& c, int salt) {
  const bool widen = c.dtype == at::kHalf || c.dtype == at::kBFloat16;
  auto in = [&](int r) {
    at::Tensor x = input(r, c.numel, c.dtype, salt);
    return widen ? x.to(at::kFloat) : x.dtype() == at::kBool ? x.to(at::kByte) : x;
  };
  at::Tensor acc = in(0);
  for (int r = 1; r < w; ++r) {
    switch (c.op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg: acc = acc + in(r); break;
      case ReduceOp::Max: acc = at::maximum(acc, in(r)); break;
      case ReduceOp::Min: acc = at::minimum(acc, in(r)); break;
    }
  }
  if (c.op == ReduceOp::Avg) acc = acc / w;
  return acc.to(c.dtype);
}

// |a - b| <= bound elementwise, where two sums of the same W terms in other
// orders differ by at most 2 (W - 1) eps sum|x_r| (each order's error is at
// most (W - 1) eps sum|x_r|), plus one rounding of the result to the dtype.
void expectWithinSumBound(const at::Tensor& a, const at::Tensor& b, int w, const Case& c, int salt,
                          const std::string& what) {
  double eps = 0;
  if (c.dtype == at::kFloat) eps = std::numeric_limits<float>::epsilon();
  if (c.dtype == at::kDouble) eps = std::numeric_limits<double>::epsilon();
  if (c.dtype == at::kHalf) eps = 0.0009765625;      // 2^-10
  if (c.dtype == at::kBFloat16) eps = 0.0078125;     // 2^-7
  at::Tensor mag = at::zeros({c.numel}, at::kDouble);
  for (int r = 0; r < w; ++r) mag += input(r, c.numel, c.dtype, salt).to(at::kDouble).abs();
  if (c.op == ReduceOp::Avg) mag /= w;
  const at::Tensor bound = mag * (2.0 * (w - 1) * eps) + b.to(at::kDouble).abs() * eps;
  const at::Tensor diff = (a.to(at::kDouble) - b.to(at::kDouble)).abs();
  EXPECT_TRUE(diff.le(bound).all().item<bool>()) << what << ": max |diff| " << diff.max().item<double>();
}

std::string name(const Case& c, int w) {
  return c10::str(c10::toString(c.dtype), " ", to_string(c.op), " of ", c.numel, " on ", w, " ranks");
}

class ShmCollectives : public ::testing::TestWithParam<int> {};

TEST_P(ShmCollectives, AllReduceEveryDtypeOpAndSizeClass) {
  const int w = GetParam();
  const auto cases = allReduceCases();
  auto body = [&](const ProcessGroup& g, int r) {
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < cases.size(); ++i) {
      at::Tensor t = input(r, cases[i].numel, cases[i].dtype, static_cast<int>(i));
      g.all_reduce(t, cases[i].op);
      out.push_back(t);
    }
    return out;
  };
  const Results shm = runWith(w, "1", body), gloo = runWith(w, "0", body);
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const std::string what = name(c, w);
    const bool on_shm = c.numel * ((c.dtype == at::kHalf || c.dtype == at::kBFloat16) ? 4 : c10::elementSize(c.dtype)) <= kSlot;
    for (int r = 1; r < w; ++r) EXPECT_TRUE(at::equal(shm[r][i], shm[0][i])) << what << ": ranks 0 and " << r << " differ";
    const at::Tensor want = rankOrder(w, c, static_cast<int>(i));
    const bool exact = !at::isFloatingType(c.dtype) || c.op == ReduceOp::Max || c.op == ReduceOp::Min;
    if (on_shm) EXPECT_TRUE(at::equal(shm[0][i], want)) << what << ": not the sum in rank order, bit for bit";
    if (exact) {
      EXPECT_TRUE(at::equal(shm[0][i], gloo[0][i])) << what << ": differs from Gloo";
      EXPECT_TRUE(at::equal(gloo[0][i], want)) << what << ": Gloo differs from the reference";
    } else {
      expectWithinSumBound(shm[0][i], gloo[0][i], w, c, static_cast<int>(i), what + " vs Gloo");
    }
  }
}

// All-gather of uneven shards (an empty one included) along dims 0 and 1,
// below and above the slot size: exactly the concatenation, on both paths.
TEST_P(ShmCollectives, AllGatherUnevenAlongEachDim) {
  const int w = GetParam();
  const std::vector<int64_t> sizes = w == 2 ? std::vector<int64_t>{3, 0} : std::vector<int64_t>{3, 0, 2, 1};
  struct G {
    at::ScalarType dtype;
    int64_t dim, other;  // the shard is [size, other] (dim 0) or [other, size] (dim 1)
  };
  const std::vector<G> cases{{at::kFloat, 0, 7},    {at::kFloat, 1, 7},  {at::kBool, 0, 5},
                             {at::kBFloat16, 1, 3}, {at::kLong, 0, 100}, {at::kDouble, 1, 200}};
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
  const Results shm = runWith(w, "1", body), gloo = runWith(w, "0", body);
  for (size_t i = 0; i < cases.size(); ++i) {
    std::vector<at::Tensor> pieces;
    for (int r = 0; r < w; ++r) pieces.push_back(shard(cases[i], r, static_cast<int>(i)));
    const at::Tensor want = at::cat(pieces, cases[i].dim);
    for (int r = 0; r < w; ++r) {
      EXPECT_TRUE(at::equal(shm[r][i], want)) << "case " << i << ", rank " << r << " (shared memory)";
      EXPECT_TRUE(at::equal(gloo[r][i], want)) << "case " << i << ", rank " << r << " (Gloo)";
    }
  }
}

// Reduce-scatter with uneven pieces (an empty one included): rank r gets the
// rank-order reduction of everyone's piece r.
TEST_P(ShmCollectives, ReduceScatterUneven) {
  const int w = GetParam();
  const std::vector<int64_t> sizes = w == 2 ? std::vector<int64_t>{3, 0} : std::vector<int64_t>{3, 0, 2, 1};
  const int64_t rows = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  const std::vector<Case> cases{{at::kDouble, ReduceOp::Sum, 4},   {at::kFloat, ReduceOp::Avg, 4},
                                {at::kBFloat16, ReduceOp::Sum, 4}, {at::kLong, ReduceOp::Max, 4},
                                {at::kFloat, ReduceOp::Sum, 300},  {at::kDouble, ReduceOp::Min, 300}};
  auto full = [&](const Case& c, int r, int salt) { return input(r, rows * c.numel, c.dtype, salt).view({rows, c.numel}); };
  auto body = [&](const ProcessGroup& g, int r) {
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < cases.size(); ++i)
      out.push_back(g.reduce_scatter(full(cases[i], r, static_cast<int>(i)), 0, sizes, cases[i].op).wait());
    return out;
  };
  const Results shm = runWith(w, "1", body), gloo = runWith(w, "0", body);
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const bool widen = c.dtype == at::kBFloat16;
    int64_t offset = 0;
    for (int me = 0; me < w; ++me) {
      at::Tensor acc;
      for (int r = 0; r < w; ++r) {
        at::Tensor piece = full(c, r, static_cast<int>(i)).narrow(0, offset, sizes[me]);
        if (widen) piece = piece.to(at::kFloat);
        acc = r == 0 ? piece.clone()
              : c.op == ReduceOp::Max ? at::maximum(acc, piece)
              : c.op == ReduceOp::Min ? at::minimum(acc, piece)
                                      : acc + piece;
      }
      if (c.op == ReduceOp::Avg) acc = acc / w;
      const at::Tensor want = acc.to(c.dtype);
      const bool on_shm = rows * c.numel * (widen ? 4 : c10::elementSize(c.dtype)) <= kSlot;
      if (on_shm) EXPECT_TRUE(at::equal(shm[me][i], want)) << name(c, w) << ", rank " << me << ": not rank order";
      Case piece_case = c;
      piece_case.numel = sizes[me] * c.numel;
      if (c.op == ReduceOp::Max || c.op == ReduceOp::Min || c.dtype == at::kLong)
        EXPECT_TRUE(at::equal(shm[me][i], gloo[me][i])) << name(c, w) << ", rank " << me;
      else
        EXPECT_CLOSE(shm[me][i].to(at::kDouble), gloo[me][i].to(at::kDouble), widen ? 1e-2 : 1e-6, 1e-6)
            << name(c, w) << ", rank " << me;
      offset += sizes[me];
    }
  }
}

TEST_P(ShmCollectives, BroadcastAndBarrier) {
  const int w = GetParam();
  auto body = [&](const ProcessGroup& g, int r) {
    std::vector<at::Tensor> out;
    int salt = 0;
    for (auto dt : {at::kFloat, at::kBool, at::kBFloat16})
      for (int64_t n : {int64_t{0}, int64_t{7}, int64_t{2000}}) {
        at::Tensor t = input(r, n, dt, salt++);
        g.broadcast(t, w - 1);
        g.barrier();
        out.push_back(t);
      }
    return out;
  };
  const Results shm = runWith(w, "1", body), gloo = runWith(w, "0", body);
  int salt = 0;
  for (auto dt : {at::kFloat, at::kBool, at::kBFloat16})
    for (int64_t n : {int64_t{0}, int64_t{7}, int64_t{2000}}) {
      const at::Tensor want = input(w - 1, n, dt, salt);
      for (int r = 0; r < w; ++r) {
        EXPECT_TRUE(at::equal(shm[r][salt], want)) << c10::toString(dt) << " of " << n << ", rank " << r;
        EXPECT_TRUE(at::equal(gloo[r][salt], want)) << c10::toString(dt) << " of " << n << ", rank " << r;
      }
      ++salt;
    }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ShmCollectives, ::testing::Values(2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

// The segment lives only in the ranks' mappings (mapped_shm_segments): its
// name is gone from /dev/shm once the group exists, and DTP_SHM=0 maps none.
int namedSegments() {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm"))
    n += e.path().filename().string().rfind("dtp-" + std::to_string(getpid()) + "-", 0) == 0;
  return n;
}

TEST(ShmSegments, UnlinkedOnceMappedAndOffWithDtpShm0) {
  for (const char* shm : {"1", "0"}) {
    setenv("DTP_SHM", shm, 1);
    run_ranks(2, [&](int) {
      default_process_group().barrier();  // both ranks have made the group
      EXPECT_EQ(namedSegments(), 0) << "DTP_SHM=" << shm;
      EXPECT_EQ(dtp::test::mapped_shm_segments() > 0, std::string(shm) == "1") << "DTP_SHM=" << shm;
    });
    unsetenv("DTP_SHM");
  }
  EXPECT_EQ(dtp::test::mapped_shm_segments(), 0) << "a group that ended left its segment mapped";
}

TEST(ShmSegments, BadSlotSizeIsRefusedByName) {
  setenv("DTP_SHM_MAX_BYTES", "12kb", 1);
  const std::string msg = dtp::test::error_of([] {
    ProcessGroup::create(c10::make_intrusive<c10d::HashStore>(), 0, 1);
  });
  unsetenv("DTP_SHM_MAX_BYTES");
  EXPECT_NE(msg.find("DTP_SHM_MAX_BYTES='12kb'"), std::string::npos) << msg;
}

}  // namespace
