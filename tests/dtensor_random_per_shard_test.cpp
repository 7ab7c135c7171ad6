// RandomMode::PerShard: each rank draws only its shard's elements (Philox,
// NOTE: [Per-shard random numbers] in src/dtensor/philox.h), and the whole
// equals one device (dtp::per_shard::* on the plain tensor, or a 1-rank mesh)
// bit for bit, whatever the placements; the ATen tensor-op path that CUDA
// tensors take gives the CPU loop's bits.
#include "dist.h"
#include "parity.h"

#include "dtensor/philox.h"
#include "dtensor/random_state.h"
#include "dtp/ac/activation_checkpoint.h"
#include "dtp/comm_counter.h"
#include "dtp/random.h"

#include <ATen/ATen.h>

#include <cmath>

using namespace dtp;
using dtp::detail::DrawKind;
using dtp::detail::PhiloxDraw;
using dtp::test::data;
using dtp::test::run_ranks;

namespace {

constexpr uint64_t kSeed = 0x5eed0000beefULL;

// Elements whose bits differ (both tensors on CPU; NaN never drawn).
int64_t mismatches(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return -1;
  return a.ne(b).sum().item<int64_t>();
}

// ---- The generator itself (no communication) ----

// Random123's published known-answer vectors (its tests/kat_vectors).
TEST(PhiloxTest, MatchesRandom123KnownAnswers) {
  using W = std::array<uint32_t, 4>;
  EXPECT_EQ(dtp::detail::philox4x32_10({0, 0, 0, 0}, {0, 0}), (W{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(dtp::detail::philox4x32_10({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
            (W{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(dtp::detail::philox4x32_10({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (W{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

// The conversions are the NOTE's formulas: element i of a draw at stream
// offset `off` takes block i / E's words.
TEST(PhiloxTest, ConversionsAreTheDocumentedFormulas) {
  const uint64_t off = 12345;
  const int64_t n = 37;
  auto words = [&](int64_t b) {
    return dtp::detail::philox4x32_10({static_cast<uint32_t>(b), 0, static_cast<uint32_t>(off), 0},
                                 {static_cast<uint32_t>(kSeed), static_cast<uint32_t>(kSeed >> 32)});
  };
  at::Tensor f32 = at::empty({n}, at::kFloat), f64 = at::empty({n}, at::kDouble), nrm = at::empty({n}, at::kDouble),
             keep = at::empty({n}, at::kBool);
  dtp::detail::philox_fill(f32, {DrawKind::Uniform, -2., 3.}, {n}, {0}, kSeed, off);
  dtp::detail::philox_fill(f64, {DrawKind::Uniform, -2., 3.}, {n}, {0}, kSeed, off);
  dtp::detail::philox_fill(nrm, {DrawKind::Normal, 1., 2.}, {n}, {0}, kSeed, off);
  dtp::detail::philox_fill(keep, {DrawKind::Bernoulli, 0.3}, {n}, {0}, kSeed, off);
  int64_t bad_f32 = 0, bad_f64 = 0, bad_keep = 0;
  double normal_err = 0;
  for (int64_t i = 0; i < n; ++i) {
    const auto w4 = words(i / 4), w2 = words(i / 2);
    const double u24 = static_cast<double>(w4[i % 4] >> 8) * std::ldexp(1.0, -24);
    bad_f32 += f32[i].item<float>() != static_cast<float>(u24 * 5.0 + -2.0);
    bad_keep += keep[i].item<bool>() != (u24 < 0.3);
    const int s = static_cast<int>(i % 2);
    auto bits53 = [](uint32_t a, uint32_t b) { return static_cast<double>((uint64_t{a >> 5} << 26) | (b >> 6)); };
    bad_f64 += f64[i].item<double>() != bits53(w2[2 * s], w2[2 * s + 1]) * std::ldexp(1.0, -53) * 5.0 + -2.0;
    const double u1 = (bits53(w2[0], w2[1]) + 1) * std::ldexp(1.0, -53), u2 = bits53(w2[2], w2[3]) * std::ldexp(1.0, -53);
    const double z = std::sqrt(-2 * std::log(u1)) * (s == 0 ? std::cos(2 * M_PI * u2) : std::sin(2 * M_PI * u2));
    normal_err = std::max(normal_err, std::abs(nrm[i].item<double>() - (z * 2.0 + 1.0)));
  }
  EXPECT_EQ(bad_f32, 0) << "f32 uniform != (w >> 8) * 2^-24 * (to - from) + from";
  EXPECT_EQ(bad_f64, 0) << "f64 uniform != 53 bits of two words * 2^-53 * (to - from) + from";
  EXPECT_EQ(bad_keep, 0) << "bernoulli != u < p";
  EXPECT_LE(normal_err, 1e-13) << "Box-Muller with our series against libm's log, cos and sin";
  // And the draw is a normal distribution: 2e5 samples.
  at::Tensor z = at::empty({200000}, at::kDouble);
  dtp::detail::philox_fill(z, {DrawKind::Normal, 0., 1.}, {200000}, {0}, kSeed, 0);
  EXPECT_LE(std::abs(z.mean().item<double>()), 0.01);
  EXPECT_LE(std::abs(z.var().item<double>() - 1), 0.02);
  EXPECT_LE(std::abs(z.pow(4).mean().item<double>() - 3), 0.1) << "fourth moment";
}

// The path CUDA tensors take (ATen integer and float64 tensor ops) gives the
// CPU loop's bits, for every kind and dtype, on uneven boxes of 0-3 dims.
// (Run here on CPU: this machine has no GPU.)
TEST(PhiloxTest, TensorOpsPathEqualsCpuLoopBitForBit) {
  struct Box {
    std::vector<int64_t> shape, offset, sizes;
  };
  const std::vector<Box> boxes = {{{}, {}, {}},
                                  {{1001}, {3}, {997}},
                                  {{7, 13}, {2, 5}, {5, 7}},
                                  {{9, 11, 5}, {4, 3, 1}, {3, 7, 3}},
                                  {{3, 5}, {3, 0}, {0, 5}}};
  const at::Tensor probs_full = at::sigmoid(data({9, 11, 5}));
  for (const Box& box : boxes) {
    for (DrawKind kind : {DrawKind::Uniform, DrawKind::Normal, DrawKind::Bernoulli}) {
      for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kBool}) {
        if (dtype == at::kBool && kind != DrawKind::Bernoulli) continue;
        PhiloxDraw draw{kind, kind == DrawKind::Bernoulli ? 0.37 : -1.5, 2.5};
        if (kind == DrawKind::Bernoulli && box.shape.size() == 3)
          draw.probs = probs_full.slice(0, 4, 7).slice(1, 3, 10).slice(2, 1, 4).contiguous();
        at::Tensor loop = at::empty(box.sizes, dtype), ops = at::empty(box.sizes, dtype);
        dtp::detail::philox_fill(loop, draw, box.shape, box.offset, kSeed, 99, /*tensor_ops=*/false);
        dtp::detail::philox_fill(ops, draw, box.shape, box.offset, kSeed, 99, /*tensor_ops=*/true);
        EXPECT_EQ(mismatches(loop, ops), 0) << "kind " << static_cast<int>(kind) << ", " << c10::toString(dtype)
                                            << ", box " << c10::IntArrayRef(box.sizes) << " of "
                                            << c10::IntArrayRef(box.shape);
      }
    }
  }
}

// The CPU loop splits boxes over the intra-op threads (NOTE: [OpenMP in
// dtp's kernels] in cmake/openmp_kernels.cmake): the bits do not depend on
// the thread count, a box of several of its 2^14-element grains, an uneven
// row length.
TEST(PhiloxTest, CpuLoopOnTwoThreadsEqualsOneBitForBit) {
  const int threads = at::get_num_threads();
  const std::vector<int64_t> shape{400, 301}, offset{37, 5}, sizes{300, 257};
  for (DrawKind kind : {DrawKind::Uniform, DrawKind::Normal}) {
    const PhiloxDraw draw{kind, -1.5, 2.5};
    at::Tensor one = at::empty(sizes, at::kFloat), two = at::empty(sizes, at::kFloat), ops = one.clone();
    at::set_num_threads(1);
    dtp::detail::philox_fill(one, draw, shape, offset, kSeed, 7, /*tensor_ops=*/false);
    at::set_num_threads(2);
    dtp::detail::philox_fill(two, draw, shape, offset, kSeed, 7, /*tensor_ops=*/false);
    dtp::detail::philox_fill(ops, draw, shape, offset, kSeed, 7, /*tensor_ops=*/true);
    EXPECT_EQ(mismatches(one, two), 0) << "kind " << static_cast<int>(kind);
    EXPECT_EQ(mismatches(one, ops), 0) << "kind " << static_cast<int>(kind);
  }
  at::set_num_threads(threads);
}

// ---- DTensors ----

// The ops under test, each drawing twice in a row (the stream advances as on
// one device); `per` is the plain-tensor reference, `dt` the DTensor program.
struct RandomOp {
  const char* name;
  std::function<at::Tensor(const at::Tensor&)> dt, per;
};

std::vector<RandomOp> randomOps() {
  return {
      {"dropout", [](const at::Tensor& x) { return at::dropout(x, 0.3, /*train=*/true); },
       [](const at::Tensor& x) { return per_shard::dropout(x, 0.3); }},
      {"native_dropout", [](const at::Tensor& x) { return std::get<0>(at::native_dropout(x, 0.4, true)); },
       [](const at::Tensor& x) { return std::get<0>(per_shard::native_dropout(x, 0.4)); }},
      {"uniform_", [](const at::Tensor& x) { return at::empty_like(x).uniform_(-2, 3); },
       [](const at::Tensor& x) {
         at::Tensor t = at::empty_like(x);
         return per_shard::uniform_(t, -2, 3);
       }},
      {"uniform_ f64", [](const at::Tensor& x) { return at::empty_like(x, at::kDouble).uniform_(-2, 3); },
       [](const at::Tensor& x) {
         at::Tensor t = at::empty_like(x, at::kDouble);
         return per_shard::uniform_(t, -2, 3);
       }},
      {"normal_", [](const at::Tensor& x) { return at::empty_like(x).normal_(1, 2); },
       [](const at::Tensor& x) {
         at::Tensor t = at::empty_like(x);
         return per_shard::normal_(t, 1, 2);
       }},
      {"bernoulli_", [](const at::Tensor& x) { return at::empty_like(x).bernoulli_(0.6); },
       [](const at::Tensor& x) {
         at::Tensor t = at::empty_like(x);
         return per_shard::bernoulli_(t, 0.6);
       }},
      {"bernoulli(probs)", [](const at::Tensor& x) { return at::bernoulli(at::sigmoid(x)); },
       [](const at::Tensor& x) { return per_shard::bernoulli(at::sigmoid(x)); }},
      {"bernoulli(p)", [](const at::Tensor& x) { return at::bernoulli(x, 0.25); },
       [](const at::Tensor& x) { return per_shard::bernoulli(x, 0.25); }},
      {"rand_like, randn_like",  // sequenced: the operands of + have no order
       [](const at::Tensor& x) {
         at::Tensor u = at::rand_like(x);
         return u + at::randn_like(x) * 1e3;
       },
       [](const at::Tensor& x) {
         at::Tensor u = per_shard::rand_like(x);
         return u + per_shard::randn_like(x) * 1e3;
       }},
  };
}

// Two draws of each op on `x` distributed as `pls` over `mesh` equal the
// references, and only the first random op after manual_seed communicates:
// one broadcast per mesh dim of size > 1 (NOTE: [Generator sync]).
void expectShardsEqualOneDevice(const DeviceMesh& mesh, const at::Tensor& x, const Placements& pls,
                                const std::vector<std::pair<at::Tensor, at::Tensor>>& refs) {
  const auto ops = randomOps();
  dtp::manual_seed(kSeed);
  set_random_mode(RandomMode::PerShard);
  const at::Tensor dx = distribute_tensor(x, mesh, pls);
  int64_t broadcasts = 0, others = 0;
  for (size_t k = 0; k < ops.size(); ++k) {
    CommCounter comm;
    const at::Tensor got1 = ops[k].dt(dx), got2 = ops[k].dt(dx);
    broadcasts += comm.count(CollectiveType::Broadcast);
    others += comm.total_count() - comm.count(CollectiveType::Broadcast);
    const std::string where = std::string(ops[k].name) + " on " + to_string(pls);
    EXPECT_EQ(mismatches(full_tensor(got1), refs[k].first), 0) << where << ", first draw";
    EXPECT_EQ(mismatches(full_tensor(got2), refs[k].second), 0) << where << ", second draw";
  }
  int64_t dims = 0;
  for (int64_t m = 0; m < mesh.ndim(); ++m) dims += mesh.size(m) > 1;
  EXPECT_EQ(broadcasts, dims) << "one sync of the per-shard stream per mesh dim, on " << to_string(pls);
  EXPECT_EQ(others, 0) << "per-shard draws need no other collective, on " << to_string(pls);
  set_random_mode(RandomMode::Global);
}

std::vector<std::pair<at::Tensor, at::Tensor>> referenceDraws(const at::Tensor& x) {
  dtp::manual_seed(kSeed);
  std::vector<std::pair<at::Tensor, at::Tensor>> refs;
  for (const auto& op : randomOps()) {
    at::Tensor a = op.per(x);
    refs.emplace_back(a, op.per(x));
  }
  return refs;
}

TEST(DTensorRandomPerShardTest, ShardsEqualOneDeviceOn1DMeshes) {
  for (int w : {2, 4}) {
    for (std::vector<int64_t> shape : {std::vector<int64_t>{4 * w + 1, 6}, {3, 5}}) {
      const at::Tensor x = data(shape).to(at::kFloat);
      const auto refs = referenceDraws(x);
      for (const Placements& pls : {Placements{Shard(0)}, Placements{Shard(1)}, Placements{Replicate()}}) {
        SCOPED_TRACE(std::to_string(w) + " ranks, shape " + std::to_string(shape[0]) + "x" + std::to_string(shape[1]));
        run_ranks(w, [&](int) { expectShardsEqualOneDevice(init_device_mesh("cpu", {w}), x, pls, refs); });
      }
    }
  }
  // The same program on a 1-rank mesh.
  const at::Tensor x = data({9, 6}).to(at::kFloat);
  const auto refs = referenceDraws(x);
  run_ranks(1, [&](int) { expectShardsEqualOneDevice(init_device_mesh("cpu", {1}), x, {Shard(0)}, refs); });
}

TEST(DTensorRandomPerShardTest, ShardsEqualOneDeviceOn2DMeshes) {
  for (std::vector<int64_t> shape : {std::vector<int64_t>{9, 7}, {3, 5}}) {
    const at::Tensor x = data(shape).to(at::kFloat);
    const auto refs = referenceDraws(x);
    for (const Placements& pls : {Placements{Shard(0), Shard(1)}, Placements{Shard(0), Shard(0)},
                                  Placements{Replicate(), Shard(0)}, Placements{Shard(1), Shard(0)},
                                  Placements{Shard(1), Replicate()}}) {
      run_ranks(4, [&](int) { expectShardsEqualOneDevice(init_device_mesh("cpu", {2, 2}), x, pls, refs); });
    }
  }
}

// Under NOTE: [Random ops under data parallelism] each dp rank's batch part
// gets its rows of one device's draw over the whole batch.
TEST(DTensorRandomPerShardTest, DataParallelBatchEqualsOneDevice) {
  const at::Tensor batch = data({6, 5}).to(at::kFloat);  // 2 dp parts of 3 rows
  dtp::manual_seed(kSeed);
  const at::Tensor want = per_shard::dropout(batch, 0.5);
  run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    const int64_t dp = mesh.get_coordinate()[0];
    dtp::manual_seed(kSeed);
    set_random_mode(RandomMode::PerShard);
    dtp::detail::set_data_parallel_batch(mesh.get_group(0));
    const at::Tensor part = distribute_tensor(batch.narrow(0, 3 * dp, 3).contiguous(), mesh["tp"], {Shard(1)});
    const at::Tensor got = at::dropout(part, 0.5, true);
    dtp::detail::set_data_parallel_batch(ProcessGroup());
    EXPECT_EQ(mismatches(full_tensor(got), want.narrow(0, 3 * dp, 3)), 0) << "dp part " << dp;
  });
}

// Ranks seeded differently still agree, with the first rank's stream.
TEST(DTensorRandomPerShardTest, RanksSeededDifferentlyAgreeWithTheFirstRank) {
  const at::Tensor x = data({9, 6}).to(at::kFloat);
  dtp::manual_seed(kSeed);
  at::Tensor skipped = at::empty({4});
  per_shard::uniform_(skipped);  // rank 0 draws this before the mesh op, below
  const at::Tensor want = per_shard::dropout(x, 0.5);
  run_ranks(4, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    at::Tensor dx = distribute_tensor(x, mesh, {Replicate(), Shard(0)});
    dtp::manual_seed(rank == 0 ? kSeed : kSeed + rank);
    set_random_mode(RandomMode::PerShard);
    if (rank == 0) {
      at::Tensor t = at::empty({4});
      per_shard::uniform_(t);  // a plain draw: rank 0's offset moves, the others' follow at the sync
    }
    EXPECT_EQ(mismatches(full_tensor(at::dropout(dx, 0.5, true)), want), 0) << "rank " << rank;
  });
}

// Activation checkpointing replays the per-shard stream: the recomputation
// draws the first pass's masks, and the draws after it continue as without AC.
TEST(DTensorRandomPerShardTest, CheckpointedDropoutEqualsNotCheckpointed) {
  const at::Tensor x = data({7, 6});  // float64
  const at::Tensor wt = data({6, 6}, 1.0);
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    auto run = [&](bool ac) {
      dtp::manual_seed(kSeed);
      set_random_mode(RandomMode::PerShard);
      at::Tensor dx = distribute_tensor(x, mesh, {Shard(0)}).requires_grad_(true);
      at::Tensor dw = distribute_tensor(wt, mesh, {Replicate()});
      auto fn = [&](const std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{at::mm(at::dropout(in[0] * 2, 0.5, true), dw)};
      };
      at::Tensor y = ac ? dtp::checkpoint(fn, {dx})[0] : fn({dx})[0];
      y.sum().backward();
      at::Tensor after = at::rand_like(dx);  // the stream after forward and backward
      set_random_mode(RandomMode::Global);
      return std::array<at::Tensor, 3>{full_tensor(y), full_tensor(dx.grad()), full_tensor(after)};
    };
    const auto off = run(false), on = run(true);
    EXPECT_EQ(mismatches(on[0], off[0]), 0) << "forward";
    EXPECT_EQ(mismatches(on[1], off[1]), 0) << "gradient: the recomputation's masks are the first pass's";
    EXPECT_EQ(mismatches(on[2], off[2]), 0) << "the draw after backward";
    EXPECT_GT(on[1].eq(0).sum().item<int64_t>(), 0) << "dropout zeroed some gradient rows' elements";
  });
  dtp::manual_seed(kSeed);
  const at::Tensor want = at::mm(per_shard::dropout(x * 2, 0.5), wt);
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    dtp::manual_seed(kSeed);
    set_random_mode(RandomMode::PerShard);
    at::Tensor dx = distribute_tensor(x, mesh, {Shard(0)});
    at::Tensor dw = distribute_tensor(wt, mesh, {Replicate()});
    at::Tensor y = dtp::checkpoint([&](const std::vector<at::Tensor>& in) {
      return std::vector<at::Tensor>{at::mm(at::dropout(in[0] * 2, 0.5, true), dw)};
    }, {dx})[0];
    EXPECT_LE((full_tensor(y) - want).abs().max().item<double>(), 1e-12) << "checkpointed forward vs one device";
  });
}

TEST(DTensorRandomPerShardTest, GlobalIsTheDefaultMode) {
  std::thread([] { EXPECT_EQ(random_mode(), RandomMode::Global); }).join();
}

// What per-shard mode cannot draw errors naming the op and the fix.
TEST(DTensorRandomPerShardTest, ErrorsNameTheOpAndTheFix) {
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    dtp::manual_seed(kSeed);
    set_random_mode(RandomMode::PerShard);
    at::Tensor dx = distribute_tensor(data({4, 3}).to(at::kFloat), mesh, {Shard(0)});
    auto message = [](const std::function<void()>& f) {
      try {
        f();
      } catch (const c10::Error& e) {
        return std::string(e.what_without_backtrace());
      }
      return std::string("no error");
    };
    const std::string gen = message([&] { at::empty_like(dx).uniform_(0, 1, dtp::random_generator()); });
    EXPECT_NE(gen.find("explicit generator for aten::uniform_"), std::string::npos) << gen;
    EXPECT_NE(gen.find("set_random_mode(RandomMode::Global)"), std::string::npos) << gen;
    const std::string dtype = message([&] { at::rand_like(dx, at::kLong); });
    EXPECT_NE(dtype.find("aten::rand_like under RandomMode::PerShard: got dtype i64"), std::string::npos) << dtype;
    EXPECT_NE(dtype.find("use RandomMode::Global"), std::string::npos) << dtype;
    set_random_mode(RandomMode::Global);
  });
}

}  // namespace
