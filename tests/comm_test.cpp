// Collectives on 2 and 4 ranks, even and uneven sizes, against values computed
// on one device.
#include "close.h"
#include "dist.h"
#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"

#include <ATen/ATen.h>

#include <atomic>
#include <csignal>
#include <functional>
#include <thread>

using dtp::CollectiveType;
using dtp::ReduceOp;
using dtp::test::chunk_sizes;
using dtp::test::run_ranks;

namespace {

class CommTest : public ::testing::TestWithParam<int> {};

// Row counts that exercise even and uneven shards: 4k, 4k+1, 4k+3 and fewer
// rows than ranks.
std::vector<int64_t> rowCounts(int w) { return {4 * w, 4 * w + 1, 4 * w + 3, w - 1}; }

at::Tensor global(int64_t rows, int64_t cols) {
  return at::arange(rows * cols, at::kFloat).view({rows, cols});
}

at::Tensor chunkOf(const at::Tensor& t, int64_t dim, int parts, int idx) {
  auto sizes = chunk_sizes(t.size(dim), parts);
  int64_t start = 0;
  for (int i = 0; i < idx; ++i) start += sizes[i];
  return t.narrow(dim, start, sizes[idx]);
}

TEST_P(CommTest, AllReduceEveryOp) {
  const int w = GetParam();
  run_ranks(w, [&](int rank) {
    auto pg = dtp::default_process_group();
    auto mine = [&](int r) { return at::arange(6, at::kFloat) * (r + 1) - r; };
    at::Tensor sum = at::zeros({6}), mx = mine(0), mn = mine(0);
    for (int r = 0; r < w; ++r) {
      sum += mine(r);
      mx = at::maximum(mx, mine(r));
      mn = at::minimum(mn, mine(r));
    }
    dtp::CommCounter comm;
    EXPECT_TRUE(pg.all_reduce(mine(rank), ReduceOp::Sum).wait().equal(sum));
    EXPECT_CLOSE(pg.all_reduce(mine(rank), ReduceOp::Avg).wait(), sum / w, 1e-5, 1e-8);
    EXPECT_TRUE(pg.all_reduce(mine(rank), ReduceOp::Max).wait().equal(mx));
    EXPECT_TRUE(pg.all_reduce(mine(rank), ReduceOp::Min).wait().equal(mn));
    EXPECT_EQ(comm.count(CollectiveType::AllReduce), 4);
    EXPECT_EQ(comm.bytes(CollectiveType::AllReduce), 4 * 6 * 4);
    EXPECT_EQ(comm.total_count(), 4);
  });
}

TEST_P(CommTest, AllReduceNonContiguousInPlace) {
  const int w = GetParam();
  run_ranks(w, [&](int rank) {
    at::Tensor base = at::ones({3, 4}) * (rank + 1);
    at::Tensor view = base.t();  // non-contiguous
    dtp::default_process_group().all_reduce(view);
    EXPECT_TRUE(base.equal(at::ones({3, 4}) * (w * (w + 1) / 2)));
  });
}

TEST_P(CommTest, AllGatherUnevenAlongEachDim) {
  const int w = GetParam();
  run_ranks(w, [&](int rank) {
    auto pg = dtp::default_process_group();
    for (int64_t n : rowCounts(w)) {
      for (int64_t dim : {0, 1}) {
        at::Tensor full = dim == 0 ? global(n, 3) : global(3, n);
        dtp::CommCounter comm;
        at::Tensor got =
            pg.all_gather(chunkOf(full, dim, w, rank), dim, chunk_sizes(n, w)).wait();
        EXPECT_TRUE(got.equal(full)) << "n=" << n << " dim=" << dim;
        EXPECT_EQ(comm.count(CollectiveType::AllGather), 1);
        EXPECT_EQ(comm.bytes(CollectiveType::AllGather), full.numel() * 4);
      }
    }
  });
}

TEST_P(CommTest, ReduceScatterUnevenEveryOp) {
  const int w = GetParam();
  run_ranks(w, [&](int rank) {
    auto pg = dtp::default_process_group();
    for (int64_t n : rowCounts(w)) {
      for (int64_t dim : {0, 1}) {
        at::Tensor full = dim == 0 ? global(n, 3) : global(3, n);
        at::Tensor mine = full * (rank + 1);
        const double factor = w * (w + 1) / 2.0;
        at::Tensor expect = chunkOf(full, dim, w, rank);
        auto sizes = chunk_sizes(n, w);
        EXPECT_CLOSE(pg.reduce_scatter(mine, dim, sizes, ReduceOp::Sum).wait(), expect * factor, 1e-5, 1e-8)
            << "n=" << n << " dim=" << dim;
        EXPECT_CLOSE(pg.reduce_scatter(mine, dim, sizes, ReduceOp::Avg).wait(), expect * factor / w, 1e-5, 1e-8);
        EXPECT_TRUE(pg.reduce_scatter(mine, dim, sizes, ReduceOp::Max).wait().equal(expect * w));
        EXPECT_TRUE(pg.reduce_scatter(mine, dim, sizes, ReduceOp::Min).wait().equal(expect));
      }
    }
  });
}

TEST_P(CommTest, AllToAllMovesShardDimUneven) {
  const int w = GetParam();
  run_ranks(w, [&](int rank) {
    auto pg = dtp::default_process_group();
    for (int64_t n : rowCounts(w)) {
      const int64_t m = n + 2;
      at::Tensor full = global(n, m);
      // Rows sharded -> columns sharded (S(0) -> S(1)).
      dtp::CommCounter comm;
      at::Tensor got = pg.all_to_all(chunkOf(full, 0, w, rank), /*split_dim=*/1,
                                     chunk_sizes(m, w), /*cat_dim=*/0, chunk_sizes(n, w))
                           .wait();
      EXPECT_TRUE(got.equal(chunkOf(full, 1, w, rank))) << "n=" << n;
      EXPECT_EQ(comm.count(CollectiveType::AllToAll), 1);
    }
  });
}

TEST_P(CommTest, BroadcastFromLastRank) {
  const int w = GetParam();
  run_ranks(w, [&](int rank) {
    at::Tensor t = rank == w - 1 ? global(2, 5) : at::zeros({2, 5});
    dtp::default_process_group().broadcast(t, w - 1);
    EXPECT_TRUE(t.equal(global(2, 5)));
  });
}

// bfloat16 (fully_shard's mixed precision) in every collective: moved as
// its bytes, summed in float32 by all_reduce and rounded once, as one device
// rounds the float32 sum.
TEST_P(CommTest, Bfloat16InEveryCollective) {
  const int w = GetParam();
  run_ranks(w, [&](int rank) {
    auto pg = dtp::default_process_group();
    const at::Tensor full = (global(2 * w + 1, 3) / 7).to(at::kBFloat16);
    const auto sizes = chunk_sizes(2 * w + 1, w);
    EXPECT_TRUE(pg.all_gather(chunkOf(full, 0, w, rank), 0, sizes).wait().equal(full));
    at::Tensor mine = full + rank;
    at::Tensor want = at::zeros_like(full, at::kFloat);
    for (int r = 0; r < w; ++r) want += (full + r).to(at::kFloat);
    EXPECT_TRUE(pg.all_reduce(mine).wait().equal(want.to(at::kBFloat16)));
    at::Tensor rs = pg.reduce_scatter(full, 0, sizes).wait();
    EXPECT_TRUE(rs.equal((chunkOf(full, 0, w, rank).to(at::kFloat) * w).to(at::kBFloat16)));
    at::Tensor b = rank == 0 ? full.clone() : at::zeros_like(full);
    pg.broadcast(b, 0);
    EXPECT_TRUE(b.equal(full));
  });
}

TEST_P(CommTest, ScatterUnevenChunks) {
  const int w = GetParam();
  run_ranks(w, [&](int rank) {
    const int64_t n = 4 * w + 3;
    at::Tensor full = global(n, 2);
    std::vector<at::Tensor> chunks;
    if (rank == 0) {
      for (int r = 0; r < w; ++r) chunks.push_back(chunkOf(full, 0, w, r));
    }
    at::Tensor out = at::empty({chunk_sizes(n, w)[rank], 2});
    dtp::default_process_group().scatter(out, chunks, 0);
    EXPECT_TRUE(out.equal(chunkOf(full, 0, w, rank)));
  });
}

// Zero-size tensors work in every collective as on one device (Gloo divides
// by the element count and dies of SIGFPE when given none), and move nothing.
TEST_P(CommTest, ZeroSizeTensorsInEveryCollective) {
  const int w = GetParam();
  run_ranks(w, [&](int rank) {
    auto pg = dtp::default_process_group();
    dtp::CommCounter comm;
    at::Tensor e = at::zeros({0, 4});
    EXPECT_EQ(pg.all_reduce(e).wait().sizes(), e.sizes());
    EXPECT_EQ(pg.broadcast(e, w - 1).wait().sizes(), e.sizes());
    EXPECT_EQ(pg.all_gather(e, 0, std::vector<int64_t>(w, 0)).wait().sizes(), c10::IntArrayRef({0, 4}));
    EXPECT_EQ(pg.all_gather(at::zeros({2, 0}), 0, std::vector<int64_t>(w, 2)).wait().sizes(),
              c10::IntArrayRef({2 * w, 0}));
    EXPECT_EQ(pg.reduce_scatter(at::zeros({0, 4}), 0, std::vector<int64_t>(w, 0)).wait().sizes(),
              c10::IntArrayRef({0, 4}));
    EXPECT_EQ(pg.reduce_scatter(at::zeros({w, 0}), 0, std::vector<int64_t>(w, 1)).wait().sizes(),
              c10::IntArrayRef({1, 0}));
    EXPECT_EQ(pg.all_to_all(at::zeros({0, 0}), 0, std::vector<int64_t>(w, 0), 1, std::vector<int64_t>(w, 0))
                  .wait().sizes(), c10::IntArrayRef({0, 0}));
    std::vector<at::Tensor> chunks(w, at::zeros({0, 4}));
    EXPECT_EQ(pg.scatter(at::zeros({0, 4}), rank == 0 ? chunks : std::vector<at::Tensor>{}, 0).wait().sizes(),
              c10::IntArrayRef({0, 4}));
    // Only scatter still calls Gloo (with zero counts, which it takes): a
    // rank cannot tell that every other rank's chunk is empty too.
    EXPECT_EQ(comm.total_count(), comm.count(CollectiveType::Scatter)) << comm.str();
    // The same through DTensors: [0,4] and [4,0] distributed, gathered, reduced.
    auto mesh = dtp::init_device_mesh("cpu", {w});
    for (auto shape : {std::vector<int64_t>{0, 4}, std::vector<int64_t>{4, 0}}) {
      for (auto p : {dtp::Placement(dtp::Shard(0)), dtp::Placement(dtp::Shard(1)), dtp::Placement(dtp::Replicate())}) {
        at::Tensor d = dtp::distribute_tensor(at::zeros(shape), mesh, {p});
        EXPECT_EQ(dtp::full_tensor(d).sizes(), c10::IntArrayRef(shape));
        EXPECT_EQ(dtp::full_tensor(d.sum(0)).sizes(), c10::IntArrayRef({shape[1]}));
      }
    }
  });
}

TEST_P(CommTest, AsyncWorkCompletesOnWait) {
  const int w = GetParam();
  run_ranks(w, [&](int rank) {
    auto pg = dtp::default_process_group();
    dtp::Work a = pg.all_reduce(at::ones({4}) * rank, ReduceOp::Sum, /*async_op=*/true);
    dtp::Work b = pg.all_gather(at::full({1}, rank, at::kFloat), 0,
                                std::vector<int64_t>(w, 1), /*async_op=*/true);
    EXPECT_TRUE(b.wait().equal(at::arange(w, at::kFloat)));
    EXPECT_TRUE(a.wait().equal(at::ones({4}) * (w * (w - 1) / 2)));
    pg.barrier();
  });
}

// Point-to-point (NOTE: [Point-to-point]): a ring of uneven messages, each
// rank's tensor of r+1 rows sent right and received from the left, float64
// values checked exactly; counted as one send and one recv with their bytes.
TEST_P(CommTest, SendRecvRingOfUnevenMessages) {
  const int w = GetParam();
  run_ranks(w, [&](int rank) {
    auto pg = dtp::default_process_group();
    auto message = [](int r) { return at::arange((r + 1) * 3, at::kDouble).view({r + 1, 3}) * 0.1 + r; };
    const int right = (rank + 1) % w, left = (rank + w - 1) % w;
    dtp::CommCounter comm;
    dtp::Work sent = pg.isend(message(rank), right, /*tag=*/7);
    at::Tensor got = at::empty({left + 1, 3}, at::kDouble);
    pg.irecv(got, left, /*tag=*/7).wait();
    sent.wait();
    EXPECT_TRUE(got.equal(message(left)));
    EXPECT_EQ(comm.count(CollectiveType::Send), 1);
    EXPECT_EQ(comm.count(CollectiveType::Recv), 1);
    EXPECT_EQ(comm.bytes(CollectiveType::Send), (rank + 1) * 3 * 8);
    EXPECT_EQ(comm.bytes(CollectiveType::Recv), (left + 1) * 3 * 8);
    EXPECT_EQ(comm.total_count(), 2) << comm.str();
    // Blocking, in an order that matches: even ranks send first.
    at::Tensor back = at::empty({rank + 1, 3}, at::kDouble);
    if (rank % 2 == 0) {
      pg.send(got * 2, left);
      pg.recv(back, right);
    } else {
      pg.recv(back, right);
      pg.send(got * 2, left);
    }
    EXPECT_TRUE(back.equal(message(rank) * 2));
  });
}

// Both neighbours at once in one batch (no deadlock whatever the order),
// with tags telling two messages between the same pair apart, a bf16
// message, a non-contiguous target and an empty message.
TEST_P(CommTest, BatchIsendIrecvBothNeighbours) {
  const int w = GetParam();
  run_ranks(w, [&](int rank) {
    auto pg = dtp::default_process_group();
    const int right = (rank + 1) % w, left = (rank + w - 1) % w;
    auto value = [](int from, int tag) { return at::arange(6, at::kFloat).view({2, 3}) + 100 * from + tag; };
    at::Tensor from_left = at::empty({2, 3}), from_right_t = at::empty({3, 2}).t();  // non-contiguous [2, 3]
    at::Tensor half = at::empty({4}, at::kBFloat16), none = at::empty({0, 3});
    std::vector<dtp::P2POp> ops{{dtp::P2POp::Recv, from_left, left, 1},
                                {dtp::P2POp::Recv, from_right_t, right, 2},
                                {dtp::P2POp::Send, value(rank, 1), right, 1},
                                {dtp::P2POp::Send, value(rank, 2), left, 2},
                                {dtp::P2POp::Send, at::full({4}, rank + 0.5, at::kBFloat16), right, 3},
                                {dtp::P2POp::Recv, half, left, 3},
                                {dtp::P2POp::Send, at::empty({0, 3}), right, 4},
                                {dtp::P2POp::Recv, none, left, 4}};
    for (auto& work : pg.batch_isend_irecv(ops)) work.wait();
    // On 2 ranks left == right: only the tags keep the two messages apart.
    EXPECT_TRUE(from_left.equal(value(left, 1)));
    EXPECT_TRUE(from_right_t.equal(value(right, 2)));
    EXPECT_TRUE(half.equal(at::full({4}, left + 0.5, at::kBFloat16)));
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, CommTest, ::testing::Values(2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

TEST(CommErrors, PeerThatNeverArrivesTimesOutWithClearError) {
  run_ranks(2, [&](int rank) {
    if (rank == 1) {  // alive, but never joins the collective (its group closes after rank 0 gave up)
      std::this_thread::sleep_for(std::chrono::seconds(6));
      return;
    }
    try {
      dtp::default_process_group().all_reduce(at::ones({4}));
      ADD_FAILURE() << "all_reduce without a peer should fail";
    } catch (const c10::Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find("all_reduce #1 on ranks of size-2 group (global rank 0) failed: global rank 1 did not "
                         "reach it; nothing came within DTP_TIMEOUT_S=2 s"), std::string::npos) << msg;
      // One readable line: no C++ backtrace unless TORCH_SHOW_CPP_STACKTRACES=1 asks for it.
      EXPECT_EQ(msg.find("Exception raised from"), std::string::npos) << msg;
      EXPECT_GE(msg.find('\n'), msg.size() - 1) << msg;  // libtorch 1.13 ends it with one newline
    }
  }, std::chrono::seconds(2));
}

TEST(CommErrors, WrongPerRankSizesAreRejected) {
  run_ranks(2, [&](int rank) {
    auto pg = dtp::default_process_group();
    EXPECT_THROW(pg.all_gather(at::ones({2}), 0, {2}), c10::Error);       // one size, two ranks
    EXPECT_THROW(pg.all_gather(at::ones({2}), 0, {3, 3}), c10::Error);    // local has 2
    EXPECT_THROW(pg.reduce_scatter(at::ones({5}), 0, {2, 2}), c10::Error);  // sums to 4
  });
}

// A peer that never sends: the receiver's error names it, as for
// collectives (NOTE: [Who did not arrive]), and says what to check.
TEST(CommErrors, RecvFromAPeerThatNeverSendsNamesIt) {
  std::atomic<bool> reported{false};
  run_ranks(2, [&](int rank) {
    if (rank == 1) {  // alive, but never sends
      while (!reported) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      return;
    }
    try {
      dtp::default_process_group().recv(at::empty({4}), 1, /*tag=*/5);
      ADD_FAILURE() << "recv without a sender should fail";
    } catch (const c10::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("recv of message #1 from global rank 1 to global rank 0 (tag 5) failed on global rank 0: "
                         "global rank 1 did not reach it; nothing came within DTP_TIMEOUT_S=2 s"),
                std::string::npos) << msg;
      EXPECT_EQ(msg.find("Exception raised from"), std::string::npos) << msg;
    }
    reported = true;
  }, std::chrono::seconds(2));
}

TEST(CommErrors, PointToPointBadPeersAreNamedErrors) {
  run_ranks(2, [&](int rank) {
    auto pg = dtp::default_process_group();
    dtp::test::expect_error([&] { pg.send(at::ones({2}), rank); }, "names itself as the peer");
    dtp::test::expect_error([&] { pg.send(at::ones({2}), 2); }, "peer 2 is not a rank of this size-2 group");
    dtp::test::expect_error([&] { pg.recv(at::Tensor(), 1 - rank); }, "the tensor is undefined");
    // Nothing was sent: the groups are still usable.
    EXPECT_TRUE(pg.all_reduce(at::ones({1})).wait().equal(at::full({1}, 2.0f)));
  });
}

// NOTE: [Point-to-point]: a receiving tensor of another dtype or element
// count with the same bytes, or another shape, filled it with the sender's
// bytes silently. Now an error naming both; messages that fit go on.
TEST(CommErrors, PointToPointReceiveOfAnotherDtypeOrShapeIsNamed) {
  run_ranks(2, [&](int rank) {
    auto pg = dtp::default_process_group();
    const at::Tensor sent = at::arange(6, at::kFloat).reshape({2, 3});
    if (rank == 0) {
      pg.send(sent, 1, /*tag=*/3);
      return;
    }
    // A blocking recv refuses before any byte moves: the one message waits
    // for the receive that fits (NOTE: [Point-to-point]).
    dtp::test::expect_error([&] { pg.recv(at::empty({3}, at::kDouble), 0, 3); },
                            {"message #1 from global rank 0 (tag 3) is Float[2, 3], but the receiving tensor is "
                             "Double[3]. Receive into a tensor of the sender's dtype and shape",
                             "Nothing was received"});
    dtp::test::expect_error([&] { pg.recv(at::empty({6}, at::kInt), 0, 3); }, "message #1 from global rank 0 (tag 3) is Float[2, 3], but the receiving tensor is Int[6]");
    dtp::test::expect_error([&] { pg.recv(at::empty({3, 2}), 0, 3); }, "message #1 from global rank 0 (tag 3) is Float[2, 3], but the receiving tensor is Float[3, 2]");
    at::Tensor got = at::empty({2, 3});
    pg.recv(got, 0, 3);
    EXPECT_TRUE(got.equal(sent));
  });
}

// NOTE: [A dead peer is an error, not SIGPIPE]: once a group exists, a write
// to a dead peer's socket fails with EPIPE instead of ending the process.
TEST(CommErrors, GroupsIgnoreSigpipeSoADeadPeerIsAnError) {
  run_ranks(2, [&](int) {
    struct sigaction current {};
    ASSERT_EQ(::sigaction(SIGPIPE, nullptr, &current), 0);
    EXPECT_EQ(current.sa_handler, SIG_IGN);
  });
}

}  // namespace
