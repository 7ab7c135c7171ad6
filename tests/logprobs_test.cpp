// inference::logprobs over vocabulary-sharded logits (#56 item 6): the chosen
// token's logprob and the top-k (id, logprob) pairs equal one device's
// float64 log_softmax and topk at TP 1, 2 and 4, on vocabularies split
// evenly (16), unevenly (17) and leaving a rank empty (9 on 4 ranks:
// 3, 3, 3, 0), with one all-gather per call (NOTE: [Logprobs in one
// all-gather]); equal logits come lower id first; bad input is named.
#include "dist.h"

#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/inference/sampling.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <limits>

using namespace dtp;
using dtp::test::expect_error;
using dtp::test::run_ranks;

namespace {

constexpr double kTol = 1e-9;

// Random float64 logits [rows, vocab]: no two equal (with probability 1).
at::Tensor randomLogits(int64_t rows, int64_t vocab, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn({rows, vocab}, gen, at::kDouble) * 4;
}

// Chosen tokens reaching every shard: the first, the last and a middle id.
std::vector<int64_t> chosenFor(int64_t rows, int64_t vocab) {
  std::vector<int64_t> t;
  for (int64_t b = 0; b < rows; ++b) t.push_back(b % 3 == 0 ? 0 : b % 3 == 1 ? vocab - 1 : (vocab * b / 7) % vocab);
  return t;
}

// What one device computes: log_softmax of the whole float64 row, read at
// the chosen token, and at::topk's k best.
struct Reference {
  at::Tensor logp;                 // [rows, vocab]
  at::Tensor top_ids, top_logp;    // [rows, min(k, vocab)]
};

Reference reference(const at::Tensor& logits, int64_t k) {
  Reference r;
  r.logp = at::log_softmax(logits, -1);
  auto [val, idx] = at::topk(r.logp, std::min(k, logits.size(1)), -1);
  r.top_logp = val;
  r.top_ids = idx;
  return r;
}

// Compares one call's result with the reference: every chosen and top-k
// logprob within kTol, the top-k ids equal.
void expectMatches(const std::vector<inference::TokenLogprobs>& got, const std::vector<int64_t>& tokens,
                   const Reference& want, const std::string& what) {
  ASSERT_EQ(got.size(), tokens.size()) << what;
  const int64_t k = want.top_ids.size(1);
  for (size_t b = 0; b < got.size(); ++b) {
    const int64_t row = static_cast<int64_t>(b);
    EXPECT_EQ(got[b].token, tokens[b]) << what << ", row " << b;
    EXPECT_LE(std::abs(got[b].logprob - want.logp[row][tokens[b]].item<double>()), kTol)
        << what << ", row " << b << ": chosen token " << tokens[b] << " logprob " << got[b].logprob
        << ", one device " << want.logp[row][tokens[b]].item<double>();
    ASSERT_EQ(static_cast<int64_t>(got[b].top.size()), k) << what << ", row " << b;
    for (int64_t j = 0; j < k; ++j) {
      EXPECT_EQ(got[b].top[j].token, want.top_ids[row][j].item<int64_t>()) << what << ", row " << b << ", top " << j;
      EXPECT_LE(std::abs(got[b].top[j].logprob - want.top_logp[row][j].item<double>()), kTol)
          << what << ", row " << b << ", top " << j << ": " << got[b].top[j].logprob << ", one device "
          << want.top_logp[row][j].item<double>();
    }
  }
}

// The all-gather's bytes (gathered output, NOTE: [Logprobs in one
// all-gather]): per row and rank, 2 + min(k, V_r) (value, id) pairs.
int64_t gatheredBytes(int64_t rows, int64_t vocab, int w, int64_t k) {
  int64_t entries = 0;
  for (int64_t n : dtp::chunk_sizes(vocab, w)) entries += 2 + std::min(k, n);
  return rows * entries * 2 * 8;
}

const std::vector<int64_t> kVocabs = {16, 17, 9};  // 4k, 4k+1, and 3,3,3,0 on 4 ranks
const std::vector<int64_t> kTopK = {0, 1, 5, 20};  // 20 > every vocabulary here: all of it

}  // namespace

TEST(LogprobsTest, EqualOneDeviceLogSoftmaxAndTopkAtTp124) {
  const int64_t rows = 5;
  for (int64_t vocab : kVocabs) {
    const at::Tensor logits = randomLogits(rows, vocab, static_cast<uint64_t>(vocab));
    const std::vector<int64_t> tokens = chosenFor(rows, vocab);
    for (int64_t k : kTopK) {
      const Reference want = reference(logits, k);
      const std::string what = c10::str("vocab ", vocab, ", k ", k);
      // One device: a plain tensor, and [B, 1, V] as a decode step gives it.
      expectMatches(inference::logprobs(logits, tokens, k), tokens, want, what + ", plain");
      expectMatches(inference::logprobs(logits.unsqueeze(1), tokens, k), tokens, want, what + ", plain [B, 1, V]");
    }
    for (int w : {1, 2, 4}) {
      run_ranks(w, [&](int) {
        const DeviceMesh mesh = init_device_mesh("cpu", {w}, {"tp"});
        const at::Tensor sharded = distribute_tensor(logits, mesh, {Shard(1)});
        const at::Tensor replicated = distribute_tensor(logits, mesh, {Replicate()});
        for (int64_t k : kTopK) {
          const Reference want = reference(logits, k);
          const std::string what = c10::str("vocab ", vocab, " on ", w, " ranks, k ", k);
          CommCounter comm;
          expectMatches(inference::logprobs(sharded, tokens, k), tokens, want, what + ", S(1)");
          EXPECT_EQ(comm.count(CollectiveType::AllGather), w > 1 ? 1 : 0) << what << ": " << comm.str();
          EXPECT_EQ(comm.total_count(), w > 1 ? 1 : 0) << what << ": " << comm.str();
          if (w > 1) EXPECT_EQ(comm.bytes(CollectiveType::AllGather), gatheredBytes(rows, vocab, w, k)) << what;
          comm.reset();
          expectMatches(inference::logprobs(replicated, tokens, k), tokens, want, what + ", R");
          EXPECT_EQ(comm.total_count(), 0) << what << ", R: " << comm.str();
        }
      });
    }
  }
}

// A decode step's logits [B, 1, V] sharded on dim 2 (the Colwise head's
// S(-1)) over 4 ranks, vocab 9: the empty rank takes part in the all-gather.
TEST(LogprobsTest, DecodeStepShapeOverAnEmptyVocabShard) {
  const at::Tensor logits = randomLogits(3, 9, 5).unsqueeze(1);
  const std::vector<int64_t> tokens = {8, 0, 6};
  const Reference want = reference(logits.squeeze(1), 4);
  run_ranks(4, [&](int) {
    const DeviceMesh mesh = init_device_mesh("cpu", {4}, {"tp"});
    const at::Tensor sharded = distribute_tensor(logits, mesh, {Shard(2)});
    CommCounter comm;
    expectMatches(inference::logprobs(sharded, tokens, 4), tokens, want, "[3, 1, 9] S(2) on 4 ranks");
    EXPECT_EQ(comm.count(CollectiveType::AllGather), 1) << comm.str();
    EXPECT_EQ(comm.total_count(), 1) << comm.str();
    EXPECT_EQ(comm.bytes(CollectiveType::AllGather), gatheredBytes(3, 9, 4, 4));
  });
}

// Equal logits: top-k is ordered by logprob descending, then lower id, the
// same at every TP degree, ties at the cut within a shard and across shards
// included (rank shards for vocab 9: {0,1,2} {3,4,5} {6,7,8} on 3 ranks and
// 4; {0..4} {5..8} on 2).
TEST(LogprobsTest, EqualLogitsComeLowerIdFirst) {
  const at::Tensor logits = at::tensor({1., 5., 2., 5., 0., 5., 5., 3., 1.,      // 5 at ids 1, 3, 5, 6
                                        4., 4., 4., 4., 4., 4., 4., 4., 4.,      // all equal
                                        0., 0., 7., 0., 7., 7., 0., 0., 7.,      // 7 at 2, 4, 5, 8
                                        -1., 2., 2., -1., -1., 2., 3., 2., 2.},  // 3 at 6, then 2 at 1, 2, 5, 7, 8
                                       at::kDouble)
                                .view({4, 9});
  const std::vector<std::vector<int64_t>> ids = {{1, 3, 5, 6, 7, 2, 0, 8, 4},
                                                 {0, 1, 2, 3, 4, 5, 6, 7, 8},
                                                 {2, 4, 5, 8, 0, 1, 3, 6, 7},
                                                 {6, 1, 2, 5, 7, 8, 0, 3, 4}};
  const at::Tensor logp = at::log_softmax(logits, -1);
  const std::vector<int64_t> tokens = {3, 8, 5, 0};
  auto check = [&](const at::Tensor& x, const std::string& what) {
    for (int64_t k : {1, 2, 3, 5, 9, 20}) {
      const auto got = inference::logprobs(x, tokens, k);
      for (int64_t b = 0; b < 4; ++b) {
        std::vector<int64_t> gotIds;
        for (const auto& t : got[b].top) gotIds.push_back(t.token);
        const std::vector<int64_t> wantIds(ids[b].begin(), ids[b].begin() + std::min<int64_t>(k, 9));
        EXPECT_EQ(gotIds, wantIds) << what << ", row " << b << ", k " << k;
        for (const auto& t : got[b].top) {
          EXPECT_LE(std::abs(t.logprob - logp[b][t.token].item<double>()), kTol) << what << ", row " << b;
        }
        EXPECT_LE(std::abs(got[b].logprob - logp[b][tokens[b]].item<double>()), kTol) << what << ", row " << b;
      }
    }
  };
  check(logits, "one device");
  for (int w : {2, 3, 4}) {
    run_ranks(w, [&](int) {
      const DeviceMesh mesh = init_device_mesh("cpu", {w}, {"tp"});
      check(distribute_tensor(logits, mesh, {Shard(1)}), c10::str(w, " ranks"));
    });
  }
}

// Infinite logits: a -inf token has logprob -inf and sorts last; the row's
// other logprobs are one device's.
TEST(LogprobsTest, MinusInfinityLogitsAsOneDevice) {
  const double inf = std::numeric_limits<double>::infinity();
  const at::Tensor logits = at::tensor({-inf, 1., -inf, 2., 0.5, -inf, 3., -inf, -inf}, at::kDouble).view({1, 9});
  const at::Tensor logp = at::log_softmax(logits, -1);
  auto check = [&](const at::Tensor& x, const std::string& what) {
    const auto got = inference::logprobs(x, {2}, 5)[0];
    EXPECT_EQ(got.logprob, -inf) << what;
    const std::vector<int64_t> ids = {6, 3, 1, 4, 0};  // then the other -inf: 2, 5, 7, 8
    ASSERT_EQ(got.top.size(), ids.size()) << what;
    for (size_t j = 0; j < ids.size(); ++j) {
      EXPECT_EQ(got.top[j].token, ids[j]) << what << ", top " << j;
      if (j < 4) EXPECT_LE(std::abs(got.top[j].logprob - logp[0][ids[j]].item<double>()), kTol) << what;
    }
    EXPECT_EQ(got.top[4].logprob, -inf) << what;
  };
  check(logits, "one device");
  run_ranks(4, [&](int) {
    const DeviceMesh mesh = init_device_mesh("cpu", {4}, {"tp"});
    check(distribute_tensor(logits, mesh, {Shard(1)}), "4 ranks");
  });
}

TEST(LogprobsTest, BadInputIsNamed) {
  const at::Tensor logits = at::zeros({2, 9}, at::kDouble);
  expect_error([&] { inference::logprobs(logits, {0, 1}, 21); },
               {"logprobs: top_k for the top logprobs: got 21, expected 0 to 20"});
  expect_error([&] { inference::logprobs(logits, {0, 1}, -1); }, {"got -1, expected 0 to 20"});
  expect_error([&] { inference::logprobs(logits, {0, 9}, 1); },
               {"logprobs: chosen token of row 1: got 9, expected 0 <= id < 9"});
  expect_error([&] { inference::logprobs(logits, {-1, 0}, 1); }, {"chosen token of row 0: got -1"});
  expect_error([&] { inference::logprobs(logits, {0}, 1); },
               {"logprobs: chosen tokens for logits [2, 9]: got 1, expected one per row (2)"});
  expect_error([&] { inference::logprobs(at::zeros({9}), {0}, 1); }, {"logprobs: logits must be [B, V] or [B, 1, V]"});
  run_ranks(4, [&](int) {
    const DeviceMesh mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    const at::Tensor x = distribute_tensor(logits, mesh, {Replicate(), Shard(1)});
    expect_error([&] { inference::logprobs(x, {0, 1}, 1); },
                 {"logprobs: mesh for logits", "got 2 dims, expected 1", "mesh[\"tp\"]"});
    const DeviceMesh tp = init_device_mesh("cpu", {4}, {"tp"});
    expect_error([&] { inference::logprobs(distribute_tensor(logits, tp, {Shard(0)}), {0, 1}, 1); },
                 {"logprobs: logits", "sharded on dim 0"});
    // An out-of-range id is refused on every rank before any collective.
    const at::Tensor sharded = distribute_tensor(logits, tp, {Shard(1)});
    CommCounter comm;
    expect_error([&] { inference::logprobs(sharded, {0, 9}, 1); }, {"chosen token of row 1: got 9"});
    EXPECT_EQ(comm.total_count(), 0) << comm.str();
  });
}
