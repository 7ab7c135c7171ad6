// Empty shards (#55): every op and style that can meet a rank holding none
// of a sharded dim, at a world size that leaves one empty
// (f64[9,6](S(0)) on 4 ranks -> local rows 3,3,3,0), against one device in
// float64, values and gradients, with the collectives of each step counted:
// vocabulary-sharded embeddings, the Colwise / Rowwise / Sequence styles on
// fewer features than ranks, loss_parallel over an empty class shard,
// sampling over an empty vocabulary shard, MoE ranks without tokens (and
// experts without tokens), ExpertTensorParallel on fewer hidden units than
// ranks, and fully_shard units whose shard is empty on some ranks. The op
// sweep (op_sweep_test.cpp) checks the same for every op with a rule.
#include "close.h"
#include "dist.h"
#include "llama_util.h"
#include "parity.h"

#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/fsdp/fully_shard.h"
#include "dtp/inference/sampling.h"
#include "dtp/models/llama.h"
#include "dtp/models/moe.h"
#include "dtp/models/parallelize.h"
#include "dtp/nn/modules.h"
#include "dtp/optim/adamw.h"
#include "dtp/optim/clip_grad.h"
#include "dtp/tp/loss_parallel.h"
#include "dtp/tp/parallelize.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <mutex>

using namespace dtp;
using dtp::test::data;
using dtp::test::expect_error;
using dtp::test::run_ranks;
namespace F = torch::nn::functional;

namespace {

// (world size, size of the sharded dim): each leaves the last rank empty.
const std::vector<std::pair<int, int64_t>> kEmptyLast = {{4, 9}, {4, 3}, {2, 1}};

template <class M>
void setDeterministic(M& m) {
  torch::NoGradGuard g;
  m->to(at::kDouble);
  double seed = 0;
  for (auto& p : m->parameters()) p.copy_(data(p.sizes().vec(), seed += 1));
}

// run_ranks with `what` traced on every rank too (gtest's traces are per
// thread).
void runRanks(int w, const std::string& what, const std::function<void(int)>& body) {
  SCOPED_TRACE(what);
  run_ranks(w, [&](int rank) {
    SCOPED_TRACE(what);
    body(rank);
  });
}

at::Tensor chunkOf(const at::Tensor& t, int64_t dim, int w, int r) {
  return t.narrow(dim, chunk_start(t.size(dim), w, r), chunk_size(t.size(dim), w, r));
}

// ---------------------------------------------------------------------------
// Embeddings and the TP styles.

// RowwiseParallel on Embedding(9, 6) at 4 ranks (vocabulary rows 3,3,3,0):
// the empty rank looks nothing up and contributes zeros to the P(sum)
// output; forward one all-reduce, backward none, and the empty rank's
// gradient is its [0, 6] shard.
TEST(EmptyShardTest, RowwiseEmbeddingWithAnEmptyVocabShardEqualsOneDevice) {
  for (const auto& [w, vocab] : kEmptyLast) {
    ASSERT_EQ(chunk_sizes(vocab, w).back(), 0);
    runRanks(w, c10::str("vocab ", vocab, " on ", w, " ranks"), [&, w = w, vocab = vocab](int rank) {
      auto mesh = init_device_mesh("cpu", {w});
      at::Tensor ids = at::remainder(at::arange(12, at::kLong) * 5, vocab).view({3, 4});
      for (bool padding : {false, true}) {
        SCOPED_TRACE(padding ? "padding_idx 0" : "no padding_idx");
        auto opts = torch::nn::EmbeddingOptions(vocab, 6);
        if (padding) opts.padding_idx(0);
        dtp::nn::Embedding m(opts), ref(opts);
        setDeterministic(m);
        setDeterministic(ref);
        parallelize_module(*m, mesh, RowwiseParallel(RowwiseParallelOptions().input_layouts(Replicate())));
        EXPECT_EQ(to_local(m->weight).size(0), chunk_size(vocab, w, rank));
        CommCounter fwd;
        at::Tensor y = m(ids);
        EXPECT_EQ(fwd.count(CollectiveType::AllReduce), 1) << fwd.str();
        EXPECT_EQ(fwd.total_count(), 1) << fwd.str();
        at::Tensor ry = ref(ids);
        EXPECT_CLOSE(y, ry, 0.0, 1e-15);
        at::Tensor g = data({3, 4, 6}, 0.7);
        CommCounter bwd;
        (y * g).sum().backward();
        EXPECT_EQ(bwd.total_count(), 0) << bwd.str();
        (ry * g).sum().backward();
        EXPECT_EQ(placements(m->weight.grad()), Placements{Shard(0)});
        EXPECT_EQ(to_local(m->weight.grad()).sizes(), to_local(m->weight).sizes());
        EXPECT_CLOSE(full_tensor(m->weight.grad()), ref->weight.grad(), 0.0, 1e-15);
      }
    });
  }
}

// The op itself on a (2, 2) mesh, vocabulary 3 on both dims ((1, 1), (1, 0)
// rows): MaskP(0,3) on both, and the weight's gradient S(0)S(0), through
// the vocab-sharded backward, with replicated and with batch-sharded ids.
TEST(EmptyShardTest, VocabShardedEmbeddingOpOnTwoDimensionalMesh) {
  run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    const at::Tensor weight = data({3, 5}), ids = at::remainder(at::arange(8, at::kLong) * 2, 3).view({4, 2});
    const at::Tensor g = data({4, 2, 5}, 0.3);
    at::Tensor rw = weight.clone().requires_grad_(true);
    at::Tensor ry = at::embedding(rw, ids);
    (ry * g).sum().backward();
    for (bool batch_sharded : {false, true}) {
      SCOPED_TRACE(batch_sharded ? "ids S(0)R" : "ids RR");
      at::Tensor dw = distribute_tensor(weight.clone().requires_grad_(true), mesh, {Shard(0), Shard(0)});
      at::Tensor dids = distribute_tensor(ids, mesh, batch_sharded ? Placements{Shard(0), Replicate()}
                                                                   : Placements{Replicate(), Replicate()});
      CommCounter fwd;
      at::Tensor y = at::embedding(dw, dids);
      EXPECT_EQ(fwd.total_count(), batch_sharded ? 1 : 0) << fwd.str();  // S(0)R ids: one all-gather over dim 0
      at::Tensor full = full_tensor(y);
      EXPECT_CLOSE(full, ry, 0.0, 1e-15);
      CommCounter bwd;
      (full * g).sum().backward();
      // The gradient is MaskP(0,3) on both dims (NOTE: [MaskPartial]): the
      // vocab-sharded backward computes this rank's rows. Replicated ids:
      // nothing moves. S(0)R ids: one all-gather of the [4, 2] ids over
      // dim 0 (before MaskPartial: the general rule's [3, 5] gradient,
      // P(sum) there, reduce-scattered to the weight's S(0)).
      EXPECT_EQ(bwd.total_count(), batch_sharded ? 1 : 0) << bwd.str();
      if (batch_sharded) EXPECT_EQ(bwd.count(CollectiveType::AllGather), 1) << bwd.str();
      EXPECT_EQ(placements(dw.grad()), (Placements{Shard(0), Shard(0)}));
      EXPECT_CLOSE(full_tensor(dw.grad()), rw.grad(), 0.0, 1e-15);
    }
  });
}

// ColwiseParallel on Embedding(9, 3) at 4 ranks: embedding columns 1,1,1,0.
TEST(EmptyShardTest, ColwiseEmbeddingWithFewerColumnsThanRanks) {
  for (const auto& [w, dim] : kEmptyLast) {
    runRanks(w, c10::str("dim ", dim, " on ", w, " ranks"), [&, w = w, dim = dim](int rank) {
      auto mesh = init_device_mesh("cpu", {w});
      at::Tensor ids = at::remainder(at::arange(12, at::kLong) * 5, 9).view({3, 4});
      dtp::nn::Embedding m(9, dim), ref(9, dim);
      setDeterministic(m);
      setDeterministic(ref);
      parallelize_module(*m, mesh, ColwiseParallel());
      CommCounter comm;
      at::Tensor y = m(ids);
      at::Tensor ry = ref(ids);
      ASSERT_EQ(y.sizes(), chunkOf(ry, 2, w, rank).sizes());
      EXPECT_CLOSE(y, chunkOf(ry, 2, w, rank), 0.0, 0.0);
      at::Tensor g = data({3, 4, dim}, 0.7);
      (y * chunkOf(g, 2, w, rank)).sum().backward();
      EXPECT_EQ(comm.total_count(), 0) << comm.str();
      (ry * g).sum().backward();
      EXPECT_EQ(placements(m->weight.grad()), Placements{Shard(1)});
      EXPECT_CLOSE(full_tensor(m->weight.grad()), ref->weight.grad(), 0.0, 1e-15);
    });
  }
}

// ColwiseParallel on Linear(6, n) and RowwiseParallel on Linear(n, 5) with
// n features leaving the last rank none: Colwise moves nothing forward and
// all-reduces the input's gradient once; Rowwise all-reduces its output once
// and moves nothing backward.
TEST(EmptyShardTest, ColwiseAndRowwiseLinearWithFewerFeaturesThanRanks) {
  for (const auto& [w, n] : kEmptyLast) {
    runRanks(w, c10::str(n, " features on ", w, " ranks"), [&, w = w, n = n](int rank) {
      auto mesh = init_device_mesh("cpu", {w});
      {
        dtp::nn::Linear m(6, n), ref(6, n);
        setDeterministic(m);
        setDeterministic(ref);
        parallelize_module(*m, mesh, ColwiseParallel());
        at::Tensor x = data({5, 6}).requires_grad_(true), rx = data({5, 6}).requires_grad_(true);
        CommCounter fwd;
        at::Tensor y = m(x);
        EXPECT_EQ(fwd.total_count(), 0) << fwd.str();
        at::Tensor ry = ref(rx);
        EXPECT_CLOSE(y, chunkOf(ry, 1, w, rank), 0.0, 0.0);
        at::Tensor g = data({5, n}, 0.4);
        CommCounter bwd;
        (y * chunkOf(g, 1, w, rank)).sum().backward();
        EXPECT_EQ(bwd.count(CollectiveType::AllReduce), 1) << bwd.str();
        EXPECT_EQ(bwd.total_count(), 1) << bwd.str();
        (ry * g).sum().backward();
        EXPECT_CLOSE(x.grad(), rx.grad(), 0.0, 1e-15);
        EXPECT_CLOSE(full_tensor(m->weight.grad()), ref->weight.grad(), 0.0, 1e-15);
        EXPECT_CLOSE(full_tensor(m->bias.grad()), ref->bias.grad(), 0.0, 1e-15);
      }
      {
        dtp::nn::Linear m(n, 5), ref(n, 5);
        setDeterministic(m);
        setDeterministic(ref);
        parallelize_module(*m, mesh, RowwiseParallel());
        const at::Tensor full = data({3, n});
        at::Tensor x = chunkOf(full, 1, w, rank).clone().requires_grad_(true);
        at::Tensor rx = full.clone().requires_grad_(true);
        CommCounter fwd;
        at::Tensor y = m(x);
        EXPECT_EQ(fwd.count(CollectiveType::AllReduce), 1) << fwd.str();
        EXPECT_EQ(fwd.total_count(), 1) << fwd.str();
        at::Tensor ry = ref(rx);
        EXPECT_CLOSE(y, ry, 0.0, 1e-15);
        at::Tensor g = data({3, 5}, 0.4);
        CommCounter bwd;
        (y * g).sum().backward();
        EXPECT_EQ(bwd.total_count(), 0) << bwd.str();
        (ry * g).sum().backward();
        EXPECT_EQ(x.grad().sizes(), x.sizes());
        EXPECT_CLOSE(x.grad(), chunkOf(rx.grad(), 1, w, rank), 0.0, 1e-15);
        EXPECT_CLOSE(full_tensor(m->weight.grad()), ref->weight.grad(), 0.0, 1e-15);
        EXPECT_CLOSE(full_tensor(m->bias.grad()), ref->bias.grad(), 0.0, 1e-15);
      }
    });
  }
}

// SequenceParallel on a LayerNorm with a sequence shorter than the ranks,
// its input a DTensor S(1) as a Rowwise embedding's Shard(1) output gives it
// (a plain input is taken as an even shard, PyTorch's from_local): no
// collective forward, the weight's and bias's Partial gradients in one
// all-reduce backward.
TEST(EmptyShardTest, SequenceParallelWithFewerPositionsThanRanks) {
  for (const auto& [w, seq] : kEmptyLast) {
    runRanks(w, c10::str("sequence ", seq, " on ", w, " ranks"), [&, w = w, seq = seq](int rank) {
      auto mesh = init_device_mesh("cpu", {w});
      dtp::nn::LayerNorm ln(torch::nn::LayerNormOptions({6})), ref(torch::nn::LayerNormOptions({6}));
      setDeterministic(ln);
      setDeterministic(ref);
      parallelize_module(*ln, mesh, SequenceParallel());
      const at::Tensor full = data({2, seq, 6});
      at::Tensor x = distribute_tensor(full.clone().requires_grad_(true), mesh, {Shard(1)});
      EXPECT_EQ(to_local(x).size(1), chunk_size(seq, w, rank));
      at::Tensor rx = full.clone().requires_grad_(true);
      CommCounter fwd;
      at::Tensor y = ln(x);
      EXPECT_EQ(fwd.total_count(), 0) << fwd.str();
      EXPECT_EQ(placements(y), Placements{Shard(1)});
      at::Tensor ry = ref(rx);
      EXPECT_CLOSE(full_tensor(y), ry, 0.0, 1e-14);
      const at::Tensor g = data({2, seq, 6}, 0.2);
      CommCounter bwd;
      (to_local(y) * chunkOf(g, 1, w, rank)).sum().backward();
      EXPECT_EQ(bwd.count(CollectiveType::AllReduce), 1) << bwd.str();
      EXPECT_EQ(bwd.total_count(), 1) << bwd.str();
      (ry * g).sum().backward();
      EXPECT_CLOSE(to_local(x.grad()), chunkOf(rx.grad(), 1, w, rank), 0.0, 1e-14);
      EXPECT_CLOSE(full_tensor(ln->weight.grad()), ref->weight.grad(), 0.0, 1e-14);
      EXPECT_CLOSE(full_tensor(ln->bias.grad()), ref->bias.grad(), 0.0, 1e-14);
    });
  }
}

// The reference Llama with a vocabulary of 9 at tp 4 (SP on): the Rowwise
// embedding, the Colwise output head and loss_parallel each meet the empty
// vocabulary shard of rank 3. One forward and backward equal one device's in
// float64, with as many collectives of each kind as with the usual
// vocabulary of 67 (whose shards are all full).
TEST(EmptyShardTest, LlamaWithFewerVocabularyRowsPerRankTrainsLikeOneDevice) {
  const int w = 4;
  auto step = [](models::Llama& model, const at::Tensor& batch) {
    const at::Tensor loss = models::llama_loss(model(batch.narrow(1, 0, dtp::test::kSeq)),
                                               batch.narrow(1, 1, dtp::test::kSeq));
    loss.backward();
    std::vector<std::pair<std::string, at::Tensor>> grads;
    for (auto& [name, p] : model->unique_named_parameters())
      grads.emplace_back(name, is_dtensor(p) ? full_tensor(p.grad()) : p.grad().clone());
    return std::make_pair(is_dtensor(loss) ? full_tensor(loss).item<double>() : loss.item<double>(), grads);
  };
  models::LlamaConfig c = dtp::test::small_llama_config(w);
  c.dtype = at::kDouble;
  c.vocab_size = 9;
  const at::Tensor batch = dtp::test::llama_batch(c.vocab_size, 0);
  models::Llama one(c);
  const auto want = step(one, batch);
  runRanks(w, "vocabulary 9 on 4 ranks", [&](int rank) {
    auto mesh = init_device_mesh("cpu", {w}, {"tp"});
    auto counts = [&](const models::LlamaConfig& config, const at::Tensor& b) {
      models::Llama model(config);
      models::apply_tensor_parallel(model, mesh, models::TensorParallelOptions{true, dtp::test::kSeq});
      CommCounter comm;
      auto got = step(model, b);
      std::vector<int64_t> per_type;  // bytes differ with the vocabulary (the embedding's gradient), counts not
      for (auto t : {CollectiveType::AllReduce, CollectiveType::AllGather, CollectiveType::ReduceScatter,
                     CollectiveType::AllToAll})
        per_type.push_back(comm.count(t));
      return std::make_tuple(per_type, comm.total_count(), got, chunk_size(config.vocab_size, w, rank) ==
                             to_local(model->tok_embeddings->weight).size(0));
    };
    models::LlamaConfig full = c;
    full.vocab_size = 67;
    const auto [want_comm, want_total, unused, full_ok] = counts(full, dtp::test::llama_batch(67, 0));
    const auto [comm, total, got, sharded_ok] = counts(c, batch);
    EXPECT_TRUE(full_ok && sharded_ok) << "the embedding is vocabulary-sharded";
    EXPECT_EQ(comm, want_comm) << "all_reduce, all_gather, reduce_scatter, all_to_all";
    EXPECT_EQ(total, want_total);
    EXPECT_NEAR(got.first, want.first, 1e-12);
    ASSERT_EQ(got.second.size(), want.second.size());
    for (size_t i = 0; i < got.second.size(); ++i)
      EXPECT_CLOSE(got.second[i].second, want.second[i].second, 0.0, 1e-12) << got.second[i].first;
  });
}

// ---------------------------------------------------------------------------
// loss_parallel over an empty class shard: the empty rank's row maximum is
// -inf (the identity of max), its sum of exponentials 0 and its picked
// log-probability 0, so nothing NaN reaches the merged statistics.

at::Tensor targetsOf(std::vector<int64_t> shape, int64_t classes) {
  return at::remainder(at::arange(c10::multiply_integers(shape), at::kLong) * 7 + 3, classes).view(shape);
}

F::CrossEntropyFuncOptions::reduction_t reductionOf(int i) {
  if (i == 0) return torch::kNone;
  if (i == 1) return torch::kMean;
  return torch::kSum;
}

// cross_entropy of `x` sharded by `pls` under the guard and through
// loss_parallel_cross_entropy, against one device: value, gradient (finite
// everywhere) and the all-reduces (forward `fwd`, backward `bwd`).
void checkLoss(const DeviceMesh& mesh, const at::Tensor& x, const at::Tensor& target, const Placements& pls,
               const F::CrossEntropyFuncOptions& opts, int64_t fwd_count, int64_t bwd_count) {
  at::Tensor rx = x.clone().requires_grad_(true);
  at::Tensor ry = F::cross_entropy(rx, target, opts);
  (ry.dim() > 0 ? ry.sum() : ry).backward();
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "loss_parallel_cross_entropy" : "cross_entropy under LossParallelGuard");
    at::Tensor dx = distribute_tensor(x, mesh, pls).requires_grad_(true);
    LossParallelGuard guard;
    CommCounter fwd;
    at::Tensor y = fused ? loss_parallel_cross_entropy(dx, target, opts) : F::cross_entropy(dx, target, opts);
    EXPECT_EQ(fwd.count(CollectiveType::AllReduce), fwd_count) << fwd.str();
    EXPECT_EQ(fwd.total_count(), fwd_count) << fwd.str();
    const at::Tensor fy = full_tensor(y);
    EXPECT_TRUE(at::isfinite(fy).all().item<bool>()) << fy;
    EXPECT_CLOSE(fy, ry, 1e-14, 1e-14);
    CommCounter bwd;
    (y.dim() > 0 ? y.sum() : y).backward();
    EXPECT_EQ(bwd.total_count(), bwd_count) << bwd.str();
    EXPECT_EQ(placements(dx.grad()), pls);
    const at::Tensor local = to_local(dx.grad());
    EXPECT_TRUE(at::isfinite(local).all().item<bool>()) << local;
    EXPECT_CLOSE(full_tensor(dx.grad()), rx.grad(), 1e-14, 1e-14);
  }
}

// 2-D logits (nll_loss) and 3-D (nll_loss2d, which views [N, C, d] as
// [N, C, 1, d]: with one class the sharded size-1 class dim), class
// weights, every reduction: forward the row maximum, the sum of exponentials
// and the picked log-probability (3 all-reduces), backward none.
TEST(EmptyShardTest, LossParallelOverAnEmptyClassShardEqualsOneDevice) {
  for (const auto& [w, classes] : kEmptyLast) {
    runRanks(w, c10::str(classes, " classes on ", w, " ranks"), [&, w = w, classes = classes](int) {
      auto mesh = init_device_mesh("cpu", {w});
      const at::Tensor weight = data({classes}, 2.0).abs() + 0.1;
      for (bool three_d : {false, true}) {
        const at::Tensor x = (three_d ? data({6, classes, 4}) : data({6, classes})) * 3;
        const at::Tensor t = three_d ? targetsOf({6, 4}, classes) : targetsOf({6}, classes);
        for (int red = 0; red < 3; ++red) {
          SCOPED_TRACE(c10::str(three_d ? "3-D" : "2-D", ", reduction ", red));
          checkLoss(mesh, x, t, {Shard(1)}, F::CrossEntropyFuncOptions().weight(weight).reduction(reductionOf(red)),
                    3, 0);
        }
      }
    });
  }
}

// Label smoothing takes the op-by-op path: forward log_softmax's 2
// all-reduces and the nll term's picked value (1); the smoothing term's class
// sum stays P(sum) in the loss until it is read. Backward: log_softmax's
// gradient is no longer nll_loss's alone, so its row sums are all-reduced
// (1).
TEST(EmptyShardTest, LossParallelLabelSmoothingOverAnEmptyClassShard) {
  for (const auto& [w, classes] : kEmptyLast) {
    runRanks(w, c10::str(classes, " classes on ", w, " ranks"), [&, w = w, classes = classes](int) {
      auto mesh = init_device_mesh("cpu", {w});
      const at::Tensor x = data({5, classes}) * 2;
      for (int red : {0, 2}) {
        SCOPED_TRACE(c10::str("reduction ", red));
        checkLoss(mesh, x, targetsOf({5}, classes), {Shard(1)},
                  F::CrossEntropyFuncOptions().label_smoothing(0.1).reduction(reductionOf(red)), 3, 1);
      }
    });
  }
}

// (2, 2) mesh, classes 3 sharded over both dims ((1, 1), (1, 0) classes):
// the 3 all-reduces once per mesh dim.
TEST(EmptyShardTest, LossParallelOverAnEmptyClassShardOnTwoDimensionalMesh) {
  run_ranks(4, [&](int) {
    auto mesh = init_device_mesh("cpu", {2, 2});
    for (int red = 0; red < 3; ++red) {
      SCOPED_TRACE(c10::str("reduction ", red));
      checkLoss(mesh, data({6, 3}) * 3, targetsOf({6}, 3), {Shard(1), Shard(1)},
                F::CrossEntropyFuncOptions().reduction(reductionOf(red)), 6, 0);
    }
  });
}

// ---------------------------------------------------------------------------
// Sampling over an empty vocabulary shard: the empty rank contributes no
// candidate (one all-gather of uneven pieces, its piece empty), and every
// rank draws what one device draws from the same generator state.
TEST(EmptyShardTest, SamplingOverAnEmptyVocabShardEqualsOneDevice) {
  const std::vector<inference::SamplingOptions> options = {
      {0.0, 0, 1.0},   // greedy
      {1.0, 2, 1.0},   // top-k below the full shards' size
      {1.0, 5, 1.0},   // top-k above it
      {0.7, 0, 1.0},   // temperature over the whole row
      {0.8, 0, 0.6},   // nucleus
      {1.3, 4, 0.8}};  // both
  for (const auto& [w, vocab] : kEmptyLast) {
    const std::string what = c10::str("vocab ", vocab, " on ", w, " ranks");
    const at::Tensor logits = data({4, vocab}, 0.9) * 3;
    std::vector<std::vector<int64_t>> want;
    for (const auto& o : options) {
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
      want.push_back(inference::sample(logits, o, gen));
    }
    runRanks(w, what, [&, w = w](int) {
      auto mesh = init_device_mesh("cpu", {w}, {"tp"});
      const at::Tensor sharded = distribute_tensor(logits, mesh, {Shard(1)});
      for (size_t i = 0; i < options.size(); ++i) {
        SCOPED_TRACE(c10::str("temperature ", options[i].temperature, " top_k ", options[i].top_k, " top_p ",
                              options[i].top_p));
        at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
        CommCounter comm;
        EXPECT_EQ(inference::sample(sharded, options[i], gen), want[i]);
        EXPECT_EQ(comm.count(CollectiveType::AllGather), 1) << comm.str();
        EXPECT_EQ(comm.total_count(), 1) << comm.str();
      }
    });
  }
}

// ---------------------------------------------------------------------------
// Mixtures of experts.

models::MoEConfig moeConfig(int64_t experts, int64_t hidden) {
  models::MoEConfig c;
  c.num_experts = experts;
  c.top_k = 2;
  c.hidden = hidden;
  return c;
}

models::MoE makeMoE(int64_t dim, const models::MoEConfig& c, double seed) {
  models::MoE m(dim, c);
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) {
    p.set_data(data(p.sizes().vec(), seed) * 0.4);
    seed += 1;
  }
  return m;
}

struct OneDevice {
  at::Tensor out, x_grad;
  std::map<std::string, at::Tensor> grads;
};

OneDevice oneDevice(models::MoE& m, const at::Tensor& x, const at::Tensor& target) {
  at::Tensor rx = x.clone().requires_grad_(true);
  at::Tensor out = m(rx);
  (out * target).sum().backward();
  OneDevice r{out.detach(), rx.grad()};
  for (auto& p : m->named_parameters()) r.grads[p.key()] = p.value().grad().clone();
  return r;
}

// Expert parallelism over `P` ranks, rank r feeding its torch.chunk of x's
// batch (x [3, 5, 8] on 4 ranks: 1, 1, 1, 0 sequences: the last rank routes
// no token at all), against one device: outputs, x's gradient, the experts'
// (S(0)) and the router's (summed over ranks). Per rank: the token counts'
// all-gather and two all-to-alls forward, the two all-to-alls again backward.
void expectExpertParallelEqualsOneDevice(int P, models::MoE& one, const at::Tensor& x, const at::Tensor& target,
                                         const std::string& what) {
  const OneDevice want = oneDevice(one, x, target);
  runRanks(P, what, [&](int r) {
    models::MoE m = makeMoE(x.size(-1), one->config, 0);
    {
      torch::NoGradGuard no_grad;
      for (auto& p : m->named_parameters()) p.value().copy_(one->named_parameters()[p.key()]);
    }
    auto mesh = init_device_mesh("cpu", {P}, {"ep"});
    models::distribute_experts(*m, mesh);
    const int64_t start = chunk_start(x.size(0), P, r), rows = chunk_size(x.size(0), P, r);
    at::Tensor xs = x.narrow(0, start, rows).clone().requires_grad_(true);
    CommCounter comm;
    at::Tensor out = m(xs);
    EXPECT_EQ(comm.count(CollectiveType::AllGather), 1) << comm.str();
    EXPECT_EQ(comm.count(CollectiveType::AllToAll), 2) << comm.str();
    EXPECT_EQ(comm.total_count(), 3) << comm.str();
    (out * target.narrow(0, start, rows)).sum().backward();
    EXPECT_EQ(comm.count(CollectiveType::AllToAll), 4) << comm.str();
    EXPECT_EQ(comm.total_count(), 5) << comm.str();
    ASSERT_EQ(out.sizes(), xs.sizes());
    EXPECT_CLOSE(out, want.out.narrow(0, start, rows), 0.0, 1e-14);
    EXPECT_CLOSE(xs.grad(), want.x_grad.narrow(0, start, rows), 0.0, 1e-14);
    for (const char* name : {"experts.w1", "experts.w2", "experts.w3"}) {
      const at::Tensor grad = m->named_parameters()[name].grad();
      ASSERT_TRUE(grad.defined()) << name;
      EXPECT_CLOSE(full_tensor(grad), want.grads.at(name), 0.0, 1e-14) << name;
    }
    at::Tensor gate = m->gate->weight.grad().clone();
    mesh.get_group(0).all_reduce(gate).wait();
    EXPECT_CLOSE(gate, want.grads.at("gate.weight"), 0.0, 1e-14);
  });
}

TEST(EmptyShardTest, ExpertParallelRankWithoutTokensEqualsOneDevice) {
  for (int P : {2, 4}) {

    models::MoE one = makeMoE(8, moeConfig(4, 6), 1);
    // Batch P - 1: the last ep rank has no sequence.
    const at::Tensor x = data({P - 1, 5, 8}, 0.2), target = data({P - 1, 5, 8}, 0.6);
    expectExpertParallelEqualsOneDevice(P, one, x, target, c10::str("ep ", P));
  }
}

// A router that sends every token to experts 0 and 1 (rank 0's at ep 2,
// ranks 0 and 1's at ep 4): the other ranks' experts get no rows, those
// ranks receive nothing and their experts' gradients are zero, as on one
// device; with the empty-batch rank of the test above too.
TEST(EmptyShardTest, ExpertParallelRanksWhoseExpertsGetNoTokens) {
  for (int P : {2, 4}) {
    for (int64_t batch : {int64_t{P}, int64_t{P - 1}}) {

      models::MoE one = makeMoE(8, moeConfig(4, 6), 3);
      {
        torch::NoGradGuard no_grad;
        one->gate->weight.abs_();
        one->gate->weight.narrow(0, 2, 2).neg_();
      }
      const at::Tensor x = data({batch, 5, 8}, 0.2).abs() + 0.1, target = data({batch, 5, 8}, 0.6);
      expectExpertParallelEqualsOneDevice(P, one, x, target, c10::str("ep ", P, ", batch ", batch));
      const OneDevice g = oneDevice(one, x, target);
      EXPECT_EQ(g.grads.at("experts.w1").narrow(0, 2, 2).abs().max().item<double>(), 0.0)
          << "experts 2 and 3 must get no token, or this test checks nothing";
    }
  }
}

// Fewer experts than ep ranks would leave a rank without an expert: a named
// error, before anything is sharded.
TEST(EmptyShardTest, FewerExpertsThanEpRanksIsANamedError) {
  run_ranks(4, [&](int) {
    models::MoE m = makeMoE(8, moeConfig(2, 6), 1);
    expect_error([&] { models::distribute_experts(*m, init_device_mesh("cpu", {4}, {"ep"})); },
                 {"distribute_experts: num_experts=2 is not divisible by the ep degree 4"});
    EXPECT_FALSE(is_dtensor(m->experts->w1));
  });
}

// ExpertTensorParallel on experts of 3 hidden units at tp 4 (1, 1, 1, 0):
// the last rank's experts compute zero partial sums. Forward moves nothing
// (the output is P(sum)); backward all-reduces the routing weights' partial
// gradient [tokens x top_k] (one all-reduce) before the router sees it; the
// input's gradient stays P(sum) until read.
TEST(EmptyShardTest, ExpertTensorParallelWithFewerHiddenUnitsThanRanks) {
  for (const auto& [w, hidden] : kEmptyLast) {

    models::MoE one = makeMoE(8, moeConfig(4, hidden), 2);
    const at::Tensor x = data({2, 5, 8}, 0.2), target = data({2, 5, 8}, 0.6);
    const OneDevice want = oneDevice(one, x, target);
    runRanks(w, c10::str("hidden ", hidden, " on ", w, " ranks"), [&, w = w, hidden = hidden](int rank) {
      models::MoE m = makeMoE(8, one->config, 0);
      {
        torch::NoGradGuard no_grad;
        for (auto& p : m->named_parameters()) p.value().copy_(one->named_parameters()[p.key()]);
      }
      auto mesh = init_device_mesh("cpu", {w}, {"tp"});
      parallelize_module(*m, mesh, {{"experts", models::ExpertTensorParallel()}});
      EXPECT_EQ(to_local(m->experts->w1).size(1), chunk_size(hidden, w, rank));
      at::Tensor xd = distribute_tensor(x, mesh, {Replicate()}).requires_grad_(true);
      CommCounter fwd;
      at::Tensor out = m(xd);
      EXPECT_EQ(fwd.total_count(), 0) << fwd.str();
      EXPECT_EQ(placements(out), Placements{Partial()});
      at::Tensor full = full_tensor(out);
      EXPECT_CLOSE(full, want.out, 0.0, 1e-14);
      CommCounter bwd;
      (full * target).sum().backward();
      EXPECT_EQ(bwd.count(CollectiveType::AllReduce), 1) << bwd.str();
      EXPECT_EQ(bwd.bytes(CollectiveType::AllReduce), 2 * 5 * 2 * 8) << bwd.str();
      EXPECT_EQ(bwd.total_count(), 1) << bwd.str();
      EXPECT_EQ(placements(xd.grad()), Placements{Partial()});
      EXPECT_CLOSE(full_tensor(xd.grad()), want.x_grad, 0.0, 1e-14);
      for (const char* name : {"experts.w1", "experts.w2", "experts.w3"}) {
        const at::Tensor grad = m->named_parameters()[name].grad();
        ASSERT_TRUE(grad.defined()) << name;
        EXPECT_EQ(to_local(grad).sizes(), to_local(m->named_parameters()[name]).sizes()) << name;
        EXPECT_CLOSE(full_tensor(grad), want.grads.at(name), 0.0, 1e-14) << name;
      }
      EXPECT_CLOSE(m->gate->weight.grad(), want.grads.at("gate.weight"), 0.0, 1e-14);
    });
  }
}

// ---------------------------------------------------------------------------
// fully_shard with parameters of fewer rows than dp ranks.

// a: weight [3, 5] and bias [3] (rows 1, 1, 1, 0 on 4 ranks); b: weight
// [1, 3] and bias [1]: b's unit is all on rank 0, its flat shard empty on
// the others.
struct TinyImpl : torch::nn::Module {
  dtp::nn::Linear a{register_module("a", dtp::nn::Linear(5, 3))};
  dtp::nn::Linear b{register_module("b", dtp::nn::Linear(3, 1))};
  at::Tensor forward(const at::Tensor& x) { return b(at::tanh(a(x))); }
};
DTP_MODULE(Tiny);

// Three AdamW steps with gradient clipping, fully_shard on b and on the
// root, dp 4 (and 2), 2 rows of the batch per rank: gradients, norms and
// parameters equal one device's at every step. Per step: the root's and b's
// all-gathers forward, b's again in backward (resharded after forward), one
// reduce-scatter per unit, and clip_grad_norm_'s one all-reduce.
TEST(EmptyShardTest, FullyShardUnitsWithEmptyShardsTrainLikeOneDevice) {
  constexpr int kSteps = 3;
  for (int w : {4, 2}) {

    const at::Tensor x = data({2 * w, 5}, 0.1), y = data({2 * w, 1}, 0.8);
    Tiny one;
    setDeterministic(one);
    std::vector<std::vector<at::Tensor>> want_grads;
    std::vector<double> want_norms;
    {
      torch::optim::AdamW opt(one->parameters(), torch::optim::AdamWOptions(0.05));
      for (int step = 0; step < kSteps; ++step) {
        opt.zero_grad();
        (one(x) - y).pow(2).mean().backward();
        want_norms.push_back(torch::nn::utils::clip_grad_norm_(one->parameters(), 0.5));
        want_grads.emplace_back();
        for (const auto& p : one->parameters()) want_grads.back().push_back(p.grad().clone());
        opt.step();
      }
    }
    runRanks(w, c10::str("dp ", w), [&](int rank) {
      auto mesh = init_device_mesh("cpu", {w}, {"dp"});
      Tiny m;
      setDeterministic(m);
      fully_shard(*m->b, mesh);
      fully_shard(*m, mesh);
      EXPECT_EQ(to_local(m->a->bias).size(0), chunk_size(3, w, rank));
      EXPECT_EQ(to_local(m->b->weight).size(0), rank == 0 ? 1 : 0);
      dtp::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(0.05));
      const at::Tensor xs = x.narrow(0, 2 * rank, 2), ys = y.narrow(0, 2 * rank, 2);
      for (int step = 0; step < kSteps; ++step) {
        SCOPED_TRACE(c10::str("step ", step));
        opt.zero_grad();
        CommCounter comm;
        (m(xs) - ys).pow(2).mean().backward();
        EXPECT_EQ(comm.count(CollectiveType::AllGather), 3) << comm.str();
        EXPECT_EQ(comm.count(CollectiveType::ReduceScatter), 2) << comm.str();
        EXPECT_EQ(comm.total_count(), 5) << comm.str();
        const double norm = clip_grad_norm_(m->parameters(), 0.5).item<double>();
        EXPECT_EQ(comm.count(CollectiveType::AllReduce), 1) << comm.str();
        EXPECT_NEAR(norm, want_norms[step], 1e-15);
        const auto params = m->parameters();
        for (size_t i = 0; i < params.size(); ++i) {
          EXPECT_EQ(to_local(params[i].grad()).sizes(), to_local(params[i]).sizes()) << i;
          EXPECT_CLOSE(full_tensor(params[i].grad()), want_grads[step][i], 0.0, 1e-15) << i;
        }
        opt.step();
      }
      const auto params = m->parameters(), ref = one->parameters();
      for (size_t i = 0; i < params.size(); ++i)
        EXPECT_CLOSE(full_tensor(params[i].detach()), ref[i], 0.0, 1e-14) << i;
    });
  }
}

}  // namespace
