// Random ops on DTensors equal a single device's for the same seed, whatever
// the placements.
#include "dist.h"
#include "parity.h"

#include "dtp/random.h"

#include <ATen/ATen.h>

using namespace dtp;
using dtp::test::data;
using dtp::test::run_ranks;

namespace {

constexpr uint64_t kSeed = 1234;

void checkRandom(const std::function<at::Tensor(const at::Tensor&)>& f) {
  for (int w : {2, 4}) {
    const at::Tensor x = data({4 * w + 1, 6}).to(at::kFloat);
    at::manual_seed(kSeed);
    // Two draws in a row: the generator must advance as on one device.
    const at::Tensor ref1 = f(x), ref2 = f(x);
    for (auto p : {Shard(0), Shard(1), Replicate()}) {
      run_ranks(w, [&](int) {
        auto mesh = init_device_mesh("cpu", {w});
        dtp::manual_seed(kSeed);
        at::Tensor dx = distribute_tensor(x, mesh, {p});
        at::Tensor got1 = f(dx), got2 = f(dx);
        EXPECT_EQ(placements(got1), Placements{p});
        EXPECT_TRUE(full_tensor(got1).equal(ref1)) << p.str() << " on " << w << " ranks";
        EXPECT_TRUE(full_tensor(got2).equal(ref2)) << p.str() << " on " << w << " ranks";
      });
    }
  }
}

TEST(DTensorRandomTest, DropoutMaskEqualsSingleDevice) {
  checkRandom([](const at::Tensor& x) { return at::dropout(x, 0.3, /*train=*/true); });
}

TEST(DTensorRandomTest, NativeDropoutEqualsSingleDevice) {
  checkRandom([](const at::Tensor& x) { return std::get<0>(at::native_dropout(x, 0.4, true)); });
}

TEST(DTensorRandomTest, FillsAndLikesEqualSingleDevice) {
  checkRandom([](const at::Tensor& x) { return at::empty_like(x).uniform_(-2, 3); });
  checkRandom([](const at::Tensor& x) { return at::empty_like(x).normal_(1, 2); });
  checkRandom([](const at::Tensor& x) { return at::rand_like(x) + at::randn_like(x); });
  checkRandom([](const at::Tensor& x) { return at::bernoulli(at::sigmoid(x)); });
}

}  // namespace

namespace {

// Ranks seeded differently (or one that drew extra numbers) still agree: the
// first random op on a mesh after manual_seed gives every rank the first
// rank's generator state, as PyTorch's RNG tracker does (NOTE: [Generator
// sync]); without it each rank's replica would hold its own numbers.
TEST(DTensorRandomTest, RanksSeededDifferentlyAgreeWithTheFirstRank) {
  const at::Tensor x = data({9, 6}).to(at::kFloat);
  at::manual_seed(kSeed);
  const at::Tensor want = at::dropout(x, 0.5, true);
  run_ranks(4, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    at::Tensor dx = distribute_tensor(x, mesh, {Replicate(), Shard(0)});
    dtp::manual_seed(rank == 0 ? kSeed : kSeed + rank);
    if (rank == 3) at::rand({7}, random_generator());  // a plain draw on one rank
    at::Tensor got = at::dropout(dx, 0.5, true);
    // Replicas of the same shard agree, and the whole equals one device seeded like rank 0.
    at::Tensor local = to_local(got).contiguous();
    at::Tensor peer = local.clone();
    mesh.get_group(0).broadcast(peer, 0);
    EXPECT_TRUE(local.equal(peer)) << "rank " << rank;
    EXPECT_TRUE(full_tensor(got).equal(want)) << "rank " << rank;
  });
}

}  // namespace
