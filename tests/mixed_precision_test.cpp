// Mixed precision beyond fully_shard: apply_mixed_precision (tensor
// parallelism alone, one device) and replicate's mp_policy (DDP), on the
// reference Llama, against one device under the same policy and against
// float64 and float32; the masters' dtype; what the gradient reductions move.
#include "dist.h"
#include "llama_util.h"

#include "dtp/amp/mixed_precision.h"
#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/fsdp/fully_shard.h"
#include "dtp/fsdp/replicate.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/optim/adamw.h"

#include <iostream>

using namespace dtp;
using namespace dtp::models;
using dtp::test::kSeq;
using dtp::test::run_ranks;

namespace {

constexpr int kSteps = 6;
constexpr double u = 1.0 / 256;  // bf16's unit roundoff, 2^-8

MixedPrecisionPolicy bf16(c10::ScalarType reduce = at::kFloat) {
  MixedPrecisionPolicy p;
  p.param_dtype = at::kBFloat16;
  p.reduce_dtype = reduce;
  return p;
}

// kSteps AdamW steps on step s's batch (this dp rank's rows), the first
// step's full gradients (float64) and its collectives.
struct MpRun {
  std::vector<double> losses;  // averaged over dp
  std::vector<std::pair<std::string, at::Tensor>> grads;
  int64_t collectives = 0;
  int64_t reduce_count = 0, reduce_bytes = 0;  // the first step's gradient reduction (see reduction())
  c10::ScalarType forward_dtype = at::kDouble;  // the head's weight as forward read it
};

// What the gradient reduction of the first step moved: over dp (DDP's
// buckets), or the "(gradient reduction)" of TP's Partial gradients.
using Reduction = std::function<std::pair<int64_t, int64_t>(const CommCounter&)>;

MpRun train(Llama& model, const ProcessGroup* dp, const Reduction& reduction = {}) {
  MpRun r;
  model->output->post_hooks.push_back([&](dtp::nn::Slots&) { r.forward_dtype = model->output->weight.scalar_type(); });
  dtp::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < kSteps; ++step) {
    at::Tensor batch = dtp::test::llama_batch(model->config.vocab_size, step);
    if (dp) batch = batch.narrow(0, dp->rank() * batch.size(0) / dp->size(), batch.size(0) / dp->size());
    at::Tensor loss;
    {
      CommCounter comm;
      loss = llama_loss(model(batch.narrow(1, 0, kSeq)), batch.narrow(1, 1, kSeq));
      opt.zero_grad();
      loss.backward();
      if (step == 0) {
        r.collectives = comm.total_count();
        if (reduction) std::tie(r.reduce_count, r.reduce_bytes) = reduction(comm);
      }
    }
    if (step == 0) {
      for (auto& [name, p] : model->unique_named_parameters()) {
        EXPECT_EQ(p.grad().scalar_type(), p.scalar_type()) << name << ": .grad in the masters' dtype";
        r.grads.emplace_back(name, (is_dtensor(p) ? full_tensor(p.grad()) : p.grad()).to(at::kDouble));
      }
    }
    opt.step();
    at::Tensor l = (is_dtensor(loss) ? full_tensor(loss) : loss).detach().to(at::kDouble).reshape({1});
    if (dp) dp->all_reduce(l, ReduceOp::Avg).wait();
    r.losses.push_back(l.item<double>());
  }
  for (auto& [name, p] : model->unique_named_parameters())
    EXPECT_EQ(p.scalar_type(), model->config.dtype) << name << ": the masters keep their dtype";
  return r;
}

// The same model on one device, plain tensors.
MpRun oneDevice(LlamaConfig c, std::optional<MixedPrecisionPolicy> policy) {
  MpRun r;
  run_ranks(1, [&](int) {
    Llama model(c);
    if (policy) apply_mixed_precision(*model, *policy);
    r = train(model, nullptr);
  });
  return r;
}

// NOTE: [Mixed-precision parity against one device] As NOTE:
// [Mixed-precision parity tolerance] in data_parallel_test.cpp: a parallel
// bf16 run sums in another order than one device's bf16 run, so it must be
// as exact as that run, not equal to it. Measured against float64 (the first
// step's gradients, same initial weights), each tensor may be 4x one
// device's distance (a random rounding of the same size; the max over a
// tensor varies ~2x between orders) plus 16 bf16 ulps of its scale. The loss
// is one bf16 number (cross-entropy of bf16 logits), rounded once at the
// end by up to u|L|: each step's loss may be 4x one device's distance from
// the reference plus 4u|L| (two ulps of L). Held against float64 and against
// float32 (the run without the policy), step by step over kSteps AdamW steps.
void expectAsExactAsOneDevice(const MpRun& got, const MpRun& one, const MpRun& f32, const MpRun& f64, const char* what) {
  ASSERT_EQ(got.grads.size(), f64.grads.size());
  double worst = 0;
  for (size_t i = 0; i < f64.grads.size(); ++i) {
    const at::Tensor& x = f64.grads[i].second;
    const double err = (got.grads[i].second - x).abs().max().item<double>();
    const double one_err = (one.grads[i].second - x).abs().max().item<double>();
    const double scale = x.abs().max().item<double>();
    EXPECT_LE(err, 4 * one_err + 16 * u * scale) << what << " " << f64.grads[i].first << ": one device " << one_err;
    EXPECT_GT(one_err, 8 * 1.2e-7 * scale) << f64.grads[i].first << ": bf16 compute must show in the gradients";
    worst = std::max(worst, err / std::max(one_err, 1e-30));
  }
  double worst_f32 = 0;
  for (const MpRun* ref : {&f64, &f32}) {
    for (int s = 0; s < kSteps; ++s) {
      const double err = std::abs(got.losses[s] - ref->losses[s]), one_err = std::abs(one.losses[s] - ref->losses[s]);
      EXPECT_LE(err, 4 * one_err + 4 * u * std::abs(ref->losses[s]))
          << what << " step " << s << " against " << (ref == &f64 ? "float64" : "float32") << ": " << got.losses[s]
          << " vs " << ref->losses[s] << ", one device's bf16 " << one.losses[s];
      if (ref == &f32) worst_f32 = std::max(worst_f32, err);
    }
  }
  EXPECT_GT(worst_f32, 0) << what << ": the bf16 losses must differ from float32's somewhere";
  std::cout << what << ": worst gradient error / one device's bf16 error " << worst << "; largest |loss - float32's| "
            << worst_f32 << " over " << kSteps << " steps\n";
}

LlamaConfig config() { return dtp::test::small_llama_config(2); }

MpRun float64Run() {
  LlamaConfig c = config();
  c.dtype = at::kDouble;
  return oneDevice(c, std::nullopt);
}

// The "(gradient reduction)" collectives: TP's Partial gradients summed over tp.
std::pair<int64_t, int64_t> gradientReduction(const CommCounter& comm) {
  int64_t count = 0, bytes = 0;
  for (const auto& rec : comm.records())
    if (rec.module == "(gradient reduction)") {
      count += rec.count;
      bytes += rec.bytes;
    }
  return {count, bytes};
}

// TP=2 with sequence parallelism (and full AC if asked) under `policy`:
// rank 0's run; every parameter a DTensor, the policy applied or not.
MpRun tensorParallelRun(const LlamaConfig& c, std::optional<MixedPrecisionPolicy> policy, bool ac = false) {
  MpRun out;
  run_ranks(2, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2}, {"tp"});
    Llama model(c);
    ParallelizeOptions o;
    o.tp = TensorParallelOptions{true, kSeq};
    if (ac) o.ac = ACOptions{};
    o.mp_policy = policy;
    parallelize_llama(model, mesh, o);
    EXPECT_EQ(has_mixed_precision(*model), policy.has_value());
    MpRun r = train(model, nullptr, gradientReduction);
    for (auto& [name, p] : model->unique_named_parameters()) EXPECT_TRUE(is_dtensor(p)) << name;
    if (rank == 0) out = r;
  });
  return out;
}

}  // namespace

// apply_mixed_precision on one device computes what fully_shard's policy
// does on a one-rank mesh, bit for bit: the same copies, the same ops.
TEST(MixedPrecision, OneDeviceEqualsFullyShardsPolicyOnOneRank) {
  const LlamaConfig c = config();
  const MpRun amp = oneDevice(c, bf16());
  MpRun fsdp;
  run_ranks(1, [&](int) {
    auto mesh = init_device_mesh("cpu", {1}, {"dp"});
    Llama model(c);
    FullyShardOptions o;
    o.mp_policy = bf16();
    apply_fsdp(model, mesh, o);
    fsdp = train(model, nullptr);
  });
  EXPECT_EQ(amp.forward_dtype, at::kBFloat16);
  EXPECT_EQ(fsdp.forward_dtype, at::kBFloat16);
  for (int s = 0; s < kSteps; ++s) EXPECT_EQ(amp.losses[s], fsdp.losses[s]) << "step " << s;
  ASSERT_EQ(amp.grads.size(), fsdp.grads.size());
  for (size_t i = 0; i < amp.grads.size(); ++i)
    EXPECT_EQ((amp.grads[i].second - fsdp.grads[i].second).abs().max().item<double>(), 0) << amp.grads[i].first;
}

// TP=2 with sequence parallelism, then apply_mixed_precision: bf16 forward,
// float32 masters and .grad; as exact as one device's bf16 run against
// float64 and float32. The collectives are a float32 TP run's; the norm
// weights' Partial gradients are summed in reduce_dtype: float32 moves
// twice the bytes of bf16.
TEST(MixedPrecision, TensorParallelBf16IsAsExactAsOneDevice) {
  const LlamaConfig c = config();
  const MpRun f64 = float64Run(), f32 = oneDevice(c, std::nullopt), one = oneDevice(c, bf16());
  const MpRun tp32 = tensorParallelRun(c, std::nullopt), tp = tensorParallelRun(c, bf16(at::kFloat)),
              tp_bf16_reduce = tensorParallelRun(c, bf16(at::kBFloat16));
  EXPECT_EQ(tp32.forward_dtype, at::kFloat);
  EXPECT_EQ(tp.forward_dtype, at::kBFloat16);
  EXPECT_EQ(tp_bf16_reduce.forward_dtype, at::kBFloat16);
  expectAsExactAsOneDevice(tp, one, f32, f64, "tp=2 bf16, float32 reduction");
  expectAsExactAsOneDevice(tp_bf16_reduce, one, f32, f64, "tp=2 bf16, bf16 reduction");
  EXPECT_EQ(tp.collectives, tp32.collectives) << "the policy adds no collective";
  EXPECT_EQ(tp_bf16_reduce.collectives, tp32.collectives);
  // Under SP the 2 norms per block and the final one have Partial gradients:
  // (2 * n_layers + 1) * dim elements, one all-reduce.
  const int64_t partial_elems = (2 * c.n_layers + 1) * c.dim;
  EXPECT_EQ(tp32.reduce_count, 1);
  EXPECT_EQ(tp32.reduce_bytes, partial_elems * 4);
  EXPECT_EQ(tp.reduce_count, 1);
  EXPECT_EQ(tp.reduce_bytes, partial_elems * 4) << "reduce_dtype float32";
  EXPECT_EQ(tp_bf16_reduce.reduce_count, 1);
  EXPECT_EQ(tp_bf16_reduce.reduce_bytes, partial_elems * 2) << "reduce_dtype bf16: half the bytes";
}

// Full activation checkpointing inside (TP, then AC, then the policy): the
// recomputation reads the forward's bf16 copies (NOTE: [Compute copies]), so
// losses and gradients equal the run without AC bit for bit. The norms'
// Partial gradients, filed by the blocks' nested backwards: under
// reduce_dtype float32 into the outer backward's bucket, one all-reduce as
// without AC; under bf16 by the policy's node in each backward reaching it
// (n_layers nested ones and the outer one for the final norm), each
// gradient once: n_layers + 1 all-reduces, the same bytes.
TEST(MixedPrecision, ActivationCheckpointingRecomputesWithTheSameCopies) {
  const LlamaConfig c = config();
  const int64_t partial_elems = (2 * c.n_layers + 1) * c.dim;
  for (const c10::ScalarType reduce : {at::kFloat, at::kBFloat16}) {
    const MpRun plain = tensorParallelRun(c, bf16(reduce));
    const MpRun checkpointed = tensorParallelRun(c, bf16(reduce), /*ac=*/true);
    for (int s = 0; s < kSteps; ++s) EXPECT_EQ(checkpointed.losses[s], plain.losses[s]) << reduce << " step " << s;
    ASSERT_EQ(checkpointed.grads.size(), plain.grads.size());
    for (size_t i = 0; i < plain.grads.size(); ++i)
      EXPECT_EQ((checkpointed.grads[i].second - plain.grads[i].second).abs().max().item<double>(), 0)
          << reduce << " " << plain.grads[i].first;
    const int64_t bytes = partial_elems * c10::elementSize(reduce);
    EXPECT_EQ(plain.reduce_count, 1) << reduce;
    EXPECT_EQ(plain.reduce_bytes, bytes) << reduce;
    EXPECT_EQ(checkpointed.reduce_count, reduce == at::kFloat ? 1 : c.n_layers + 1) << reduce;
    EXPECT_EQ(checkpointed.reduce_bytes, bytes) << reduce;
  }
}

// DDP over dp=2 with ReplicateOptions::mp_policy: each rank trains its half
// of the batch. As exact as one device's bf16 run on the whole batch; the
// bucket all-reduces are as many as float32's, with float32's bytes under
// reduce_dtype float32 and half of them under bf16.
TEST(MixedPrecision, DdpBf16IsAsExactAsOneDevice) {
  const LlamaConfig c = config();
  const MpRun f64 = float64Run(), f32 = oneDevice(c, std::nullopt), one = oneDevice(c, bf16());
  int64_t param_elems = 0;
  {
    Llama m(c);
    for (const auto& p : m->unique_parameters()) param_elems += p.numel();
  }
  auto ddpRun = [&](std::optional<MixedPrecisionPolicy> policy) {
    MpRun out;
    run_ranks(2, [&](int rank) {
      auto mesh = init_device_mesh("cpu", {2}, {"dp"});
      const ProcessGroup dp = mesh.get_group(0);
      Llama model(c);
      ParallelizeOptions o;
      o.data_parallel = DataParallel::DDP;
      o.mp_policy = policy;
      parallelize_llama(model, mesh, o);
      const auto ranks = dp.global_ranks();
      MpRun r = train(model, &dp, [&](const CommCounter& comm) {
        return std::make_pair(comm.count(CollectiveType::AllReduce, ranks), comm.bytes(CollectiveType::AllReduce, ranks));
      });
      if (rank == 0) out = r;
    });
    return out;
  };
  const MpRun dp32 = ddpRun(std::nullopt), dp = ddpRun(bf16(at::kFloat)), dp_bf16_reduce = ddpRun(bf16(at::kBFloat16));
  EXPECT_EQ(dp32.forward_dtype, at::kFloat);
  EXPECT_EQ(dp.forward_dtype, at::kBFloat16);
  expectAsExactAsOneDevice(dp, one, f32, f64, "dp=2 bf16, float32 reduction");
  expectAsExactAsOneDevice(dp_bf16_reduce, one, f32, f64, "dp=2 bf16, bf16 reduction");
  EXPECT_EQ(dp.collectives, dp32.collectives) << "the policy adds no collective";
  EXPECT_EQ(dp_bf16_reduce.collectives, dp32.collectives);
  EXPECT_GE(dp32.reduce_count, 1);
  EXPECT_EQ(dp.reduce_count, dp32.reduce_count);
  EXPECT_EQ(dp_bf16_reduce.reduce_count, dp32.reduce_count);
  EXPECT_EQ(dp32.reduce_bytes, param_elems * 4) << "every gradient once, float32";
  EXPECT_EQ(dp.reduce_bytes, param_elems * 4) << "reduce_dtype float32";
  EXPECT_EQ(dp_bf16_reduce.reduce_bytes, param_elems * 2) << "reduce_dtype bf16: half the bytes";
}

// apply_mixed_precision and the data-parallel techniques' own policies do
// not stack, in either order; the dtypes must be floating point.
TEST(MixedPrecision, Errors) {
  using dtp::test::expect_error;
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"dp"});
    const LlamaConfig c = config();
    {
      Llama model(c);
      apply_mixed_precision(*model, bf16());
      expect_error([&] { apply_mixed_precision(*model, bf16()); }, {"apply_mixed_precision", "already", "once"});
      expect_error([&] { replicate(*model, mesh); }, {"replicate", "apply_mixed_precision", "ReplicateOptions::mp_policy"});
      expect_error([&] { fully_shard(*model, mesh); }, {"fully_shard", "apply_mixed_precision", "FullyShardOptions::mp_policy"});
    }
    {
      Llama model(c);
      replicate(*model, mesh);
      expect_error([&] { apply_mixed_precision(*model, bf16()); }, {"apply_mixed_precision", "under replicate()", "mp_policy"});
      Llama inner(c);
      fully_shard(*inner->layers[0], mesh);
      expect_error([&] { apply_mixed_precision(*inner, bf16()); }, {"under fully_shard()", "FullyShardOptions"});
    }
    {  // applied to a block, then replicate on the whole model
      Llama model(c);
      apply_mixed_precision(*model->layers[0], bf16());
      expect_error([&] { replicate(*model, mesh); }, {"replicate", "has apply_mixed_precision"});
    }
    {
      Llama model(c);
      MixedPrecisionPolicy p;
      p.param_dtype = at::kInt;
      expect_error([&] { apply_mixed_precision(*model, p); }, {"param_dtype", "Int", "floating-point"});
      ReplicateOptions o;
      o.mp_policy = p;
      expect_error([&] { replicate(*model, mesh, o); }, {"replicate: mp_policy", "floating-point"});
    }
  });
}
