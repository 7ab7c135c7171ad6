// Pipeline parallelism (include/dtp/pp/pipeline.h) on ranks as threads: the
// reference Llama cut into stages, GPipe, 1F1B and interleaved 1F1B over 4
// and 8 microbatches on 2 and 4 ranks; losses and parameters after AdamW
// steps equal one device on the whole batch, in float64; the messages per
// step meet the closed form; the errors name the fix.
#include "close.h"
#include "dist.h"
#include "files.h"
#include "llama_util.h"
#include "dtp/comm_counter.h"
#include "dtp/dcp/checkpoint.h"
#include "dtp/dtensor.h"
#include "dtp/optim/adamw.h"
#include "dtp/models/llama_pipeline.h"
#include "dtp/models/parallelize.h"
#include "dtp/pp/pipeline.h"
#include "mesh/flatten.h"

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <atomic>
#include <cmath>
#include <map>
#include <mutex>
#include <set>
#include <thread>

using dtp::pp::Pipeline;
using dtp::pp::PipelineStage;
using dtp::pp::Schedule;
using namespace dtp::models;
using dtp::test::expect_error;

namespace {

constexpr int64_t kBatch = 8, kSeq = 8;
constexpr int kSteps = 3;

// The tests' small Llama (uneven vocabulary), `layers` deep, in float64.
LlamaConfig config(int64_t layers) {
  LlamaConfig c = dtp::test::small_llama_config();
  c.n_layers = layers;
  c.seed = 11;
  c.dtype = at::kDouble;
  return c;
}

at::Tensor batch(int64_t vocab, int step) {
  return at::remainder(at::arange(kBatch * (kSeq + 1), at::kLong) * 13 + step * 7, vocab).view({kBatch, kSeq + 1});
}

struct Run {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> params;  // by the whole model's names
};

Run oneDevice(const LlamaConfig& c) {
  Llama model(c);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  Run run;
  for (int step = 0; step < kSteps; ++step) {
    at::Tensor b = batch(c.vocab_size, step);
    at::Tensor loss = llama_loss(model(b.narrow(1, 0, kSeq)), b.narrow(1, 1, kSeq));
    opt.zero_grad();
    loss.backward();
    opt.step();
    run.losses.push_back(loss.item<double>());
  }
  for (const auto& item : model->named_parameters()) run.params[item.key()] = item.value().detach().clone();
  return run;
}

// NOTE: float64 parity bound. The pipeline sums the microbatches' gradients
// (each of a loss divided by m) where one device takes the mean over the
// whole batch at once: the same terms in another order, float64 rounding
// apart (~1e-16 relative). AdamW moves a weight by at most lr per step
// whatever the gradient, and amplifies a gradient change d to at most
// lr * d / eps: over 3 steps at lr 1e-2, eps 1e-8 and d <= 1e-15 that is
// 3e-9 in the worst case; measured differences are far smaller.
constexpr double kLossTol = 1e-12, kParamTol = 1e-9;

enum class Kind { GPipe, OneFOneB, Interleaved };

Schedule makeSchedule(Kind kind, int ranks, int microbatches) {
  switch (kind) {
    case Kind::GPipe: return Schedule::gpipe(ranks, microbatches);
    case Kind::OneFOneB: return Schedule::one_f_one_b(ranks, microbatches);
    case Kind::Interleaved: return Schedule::interleaved_1f1b(ranks, 2, microbatches);
  }
  return Schedule::gpipe(ranks, microbatches);
}

// Trains kSteps on `ranks` ranks and compares with one device; prints the
// largest differences and the measured bubble (the share of the last step
// each rank spent waiting for messages, averaged) beside the schedule's.
void expectEqualsOneDevice(Kind kind, int ranks, int microbatches) {
  const Schedule schedule = makeSchedule(kind, ranks, microbatches);
  const LlamaConfig c = config(4);
  const Run ref = oneDevice(c);
  std::atomic<double> wait_sum{0.0};
  std::mutex mu;
  double max_loss = 0, max_param = 0;
  dtp::test::run_ranks(ranks, [&](int rank) {
    Llama full(c);  // every rank builds the same model and keeps its stages
    std::vector<PipelineStage> stages;
    std::vector<Llama> parts;
    std::set<const void*> mine;
    for (int s = 0; s < schedule.stages(); ++s) {
      if (schedule.rank_of(s) != rank) continue;
      parts.push_back(llama_pipeline_stage(full, s, schedule.stages()));
      Llama part = parts.back();
      std::vector<int64_t> input_shape;
      if (s > 0) input_shape = {kBatch / microbatches, kSeq, c.dim};
      stages.push_back({s, [part](const at::Tensor& x) mutable { return part->forward(x); }, input_shape});
    }
    std::vector<at::Tensor> params;
    for (auto& part : parts)
      for (auto& p : part->parameters()) {
        if (mine.insert(p.unsafeGetTensorImpl()).second) params.push_back(p);
      }
    torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2));
    Pipeline pipe(schedule, stages, dtp::default_process_group(),
                  [](const at::Tensor& logits, const at::Tensor& targets) { return llama_loss(logits, targets); });
    const bool last = schedule.rank_of(schedule.stages() - 1) == rank;
    for (int step = 0; step < kSteps; ++step) {
      at::Tensor b = batch(c.vocab_size, step);
      opt.zero_grad();
      dtp::CommCounter comm;
      at::Tensor loss = pipe.step(b.narrow(1, 0, kSeq), b.narrow(1, 1, kSeq));
      opt.step();
      ASSERT_EQ(loss.defined(), last);
      if (last) {
        EXPECT_NEAR(loss.item<double>(), ref.losses[step], kLossTol) << schedule.name() << " step " << step;
        std::lock_guard<std::mutex> lock(mu);
        max_loss = std::max(max_loss, std::abs(loss.item<double>() - ref.losses[step]));
      }
      {  // per boundary: its shape (NOTE: [Pipeline boundaries]), m activations and m gradients
        int64_t sends = 0, recvs = 0, shapes_out = 0;
        for (int s = 0; s < schedule.stages(); ++s) {
          if (schedule.rank_of(s) != rank) continue;
          if (s + 1 < schedule.stages()) sends += microbatches, recvs += microbatches, ++shapes_out;  // activations out, gradients in
          if (s > 0) recvs += microbatches + 1, sends += microbatches;                 // shape and activations in, gradients out
        }
        EXPECT_EQ(comm.count(dtp::CollectiveType::Send), sends + shapes_out) << comm.str();
        EXPECT_EQ(comm.count(dtp::CollectiveType::Recv), recvs) << comm.str();
        EXPECT_EQ(comm.total_count(), sends + shapes_out + recvs) << "nothing but point-to-point: " << comm.str();
        const int64_t message = kBatch / microbatches * kSeq * c.dim * 8, shape_message = 10 * 8;
        EXPECT_EQ(comm.bytes(dtp::CollectiveType::Send), sends * message + shapes_out * shape_message);
      }
    }
    const auto& stats = pipe.last_stats();
    double expected = wait_sum.load();
    while (!wait_sum.compare_exchange_weak(expected, expected + stats.wait_seconds / stats.seconds)) {}
    int compared = 0;
    for (const auto& item : full->named_parameters()) {
      if (!mine.count(item.value().unsafeGetTensorImpl())) continue;
      const double d = (item.value().detach() - ref.params.at(item.key())).abs().max().item<double>();
      EXPECT_LE(d, kParamTol) << item.key();
      std::lock_guard<std::mutex> lock(mu);
      max_param = std::max(max_param, d);
      ++compared;
    }
    EXPECT_GT(compared, 0);
  });
  const int p = ranks, m = microbatches;
  std::printf("%s p=%d m=%d: vs one device over %d AdamW steps, max |loss diff| %.2g, max |param diff| %.2g; "
              "measured bubble (wait share of the step, rank mean; ranks are threads sharing the CPUs) %.2f, the "
              "schedule's %.2f\n", schedule.name().c_str(), p, m, kSteps, max_loss, max_param,
              wait_sum.load() / ranks, schedule.simulate().bubble);
}

TEST(PipelineTest, GPipeEqualsOneDevice) {
  expectEqualsOneDevice(Kind::GPipe, 2, 4);
  expectEqualsOneDevice(Kind::GPipe, 4, 4);
}

TEST(PipelineTest, OneFOneBEqualsOneDevice) {
  expectEqualsOneDevice(Kind::OneFOneB, 2, 4);
  expectEqualsOneDevice(Kind::OneFOneB, 4, 8);
}

TEST(PipelineTest, InterleavedEqualsOneDevice) {
  expectEqualsOneDevice(Kind::Interleaved, 2, 4);  // 4 stages of one layer on 2 ranks
}

// 3-D: (pp, dp, tp) = (2, 2, 2) on 8 ranks through pipeline_llama, in
// torchtitan's order on each stage: tensor parallelism without SP
// (activations between stages are plain replicated tensors: each tp rank
// sends its copy to the same tp rank of the next stage), activation
// checkpointing, FSDP or DDP over (dp, tp), then 1F1B over 4 microbatches
// of each dp rank's half of the batch. Also (pp, dp_replicate, dp_shard) =
// (2, 2, 2): HSDP inside the stages, 2 microbatches of each dp rank's
// quarter, the model built with deferred init (each rank allocates its
// stage's shards only; the other stage stays on the meta device). Losses
// (averaged over dp) and parameters after AdamW steps equal one device on
// the whole batch.
TEST(PipelineTest, ThreeDEqualsOneDevice) {
  const LlamaConfig c = config(4);  // tp 2 divides its heads
  const auto ref = oneDevice(c);
  for (const std::string how : {"FSDP + selective AC", "DDP + full AC", "HSDP"}) {
    const bool hsdp = how == "HSDP";
    const int kMicrobatches = hsdp ? 2 : 4;
    std::mutex mu;
    double max_loss = 0, max_param = 0;
    int64_t sends = 0;
    dtp::test::run_ranks(8, [&](int) {
      auto mesh = hsdp ? dtp::init_device_mesh("cpu", {2, 2, 2}, {"pp", "dp_replicate", "dp_shard"})
                       : dtp::init_device_mesh("cpu", {2, 2, 2}, {"pp", "dp", "tp"});
      const dtp::ProcessGroup dp = hsdp ? dtp::flattened_group(mesh, {1, 2}, "test") : mesh.get_group("dp");
      const int64_t rows = kBatch / dp.size();
      LlamaConfig built = c;
      built.deferred_init = hsdp;
      Llama full(built);
      ParallelizeOptions parallel;
      if (!hsdp) parallel.ac = ACOptions{how[0] == 'F' ? dtp::ACMode::Selective : dtp::ACMode::Full, 1};
      parallel.data_parallel = how[0] == 'D' ? DataParallel::DDP : DataParallel::FSDP;
      const LlamaPipeline pipe = pipeline_llama(full, mesh, {"1f1b", kMicrobatches}, parallel);
      if (built.deferred_init) {
        pipe.init_weights(full);
        std::set<const void*> own;
        for (const auto& p : pipe.parameters()) own.insert(p.unsafeGetTensorImpl());
        for (const auto& p : full->parameters()) EXPECT_EQ(p.is_meta(), !own.count(p.unsafeGetTensorImpl()));
      }
      ASSERT_EQ(pipe.stages.size(), 1u);
      ASSERT_EQ(pipe.has_last_stage, mesh.get_local_rank("pp") == 1);
      dtp::optim::AdamW opt(pipe.parameters(), torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < kSteps; ++step) {
        const at::Tensor b = batch(c.vocab_size, step).narrow(0, dp.rank() * rows, rows);
        opt.zero_grad();
        dtp::CommCounter comm;
        at::Tensor loss = pipe.pipeline->step(b.narrow(1, 0, kSeq), b.narrow(1, 1, kSeq));
        if (step == kSteps - 1) {  // m activations (after their shape) or m gradients out, each [B/dp/m, seq, dim]
          const int64_t shape = pipe.has_last_stage ? 0 : 1;
          EXPECT_EQ(comm.count(dtp::CollectiveType::Send), kMicrobatches + shape);
          EXPECT_EQ(comm.bytes(dtp::CollectiveType::Send), rows * kSeq * c.dim * 8 + shape * 10 * 8);
          std::lock_guard<std::mutex> lock(mu);
          sends += comm.count(dtp::CollectiveType::Send);
        }
        opt.step();
        ASSERT_EQ(loss.defined(), pipe.has_last_stage);
        if (!loss.defined()) continue;
        at::Tensor l = (dtp::is_dtensor(loss) ? dtp::full_tensor(loss) : loss).detach().clone();
        const double mean = dp.all_reduce(l, dtp::ReduceOp::Avg).wait().item<double>();
        EXPECT_NEAR(mean, ref.losses[step], kLossTol) << "step " << step;
        std::lock_guard<std::mutex> lock(mu);
        max_loss = std::max(max_loss, std::abs(mean - ref.losses[step]));
      }
      std::set<const void*> mine;
      for (const auto& p : pipe.parameters()) mine.insert(p.unsafeGetTensorImpl());
      int compared = 0;
      for (const auto& item : full->named_parameters()) {  // the whole model's names, the same order on every rank
        if (!mine.count(item.value().unsafeGetTensorImpl())) continue;
        const at::Tensor whole = dtp::is_dtensor(item.value()) ? dtp::full_tensor(item.value().detach()) : item.value();
        const double d = (whole - ref.params.at(item.key())).abs().max().item<double>();
        EXPECT_LE(d, kParamTol) << item.key();
        std::lock_guard<std::mutex> lock(mu);
        max_param = std::max(max_param, d);
        ++compared;
      }
      EXPECT_GT(compared, 0);
    });
    std::printf("3-D (pp 2, %s), %s, 1F1B m=%d: vs one device over %d AdamW steps, max |loss diff| %.2g, "
                "max |param diff| %.2g; %lld p2p sends per step over the 8 ranks\n",
                hsdp ? "dp_replicate 2, dp_shard 2" : "dp 2, tp 2", how.c_str(), kMicrobatches, kSteps, max_loss,
                max_param, static_cast<long long>(sends));
  }
}

// Checkpoints across pipeline layouts: saved after 2 AdamW steps at (pp, tp)
// = (2, 2) (each rank its stage's shards and optimizer state, named as the
// whole model), then loaded into the whole model under FSDP on dp = 2, into
// pp = 2 with an uneven split ({0, 1}: 1 and 3 layers) and into pp = 4; each
// trains the 3rd step, whose loss and parameters equal one device's.
class PipelineCheckpointTest : public dtp::test::TempDirTest {};

TEST_F(PipelineCheckpointTest, LoadsAtAnyPipelineLayoutAndTrainsOn) {
  const LlamaConfig c = config(4);  // tp 2 divides its heads
  const auto ref = oneDevice(c);
  const std::string dir = file("ck");
  auto ownParams = [](Llama& full, const std::vector<at::Tensor>& mine_list, std::map<std::string, at::Tensor>& out) {
    std::set<const void*> mine;
    for (const auto& p : mine_list) mine.insert(p.unsafeGetTensorImpl());
    for (const auto& item : full->named_parameters()) {  // the same order on every rank
      if (!mine.count(item.value().unsafeGetTensorImpl())) continue;
      out[item.key()] = dtp::is_dtensor(item.value()) ? dtp::full_tensor(item.value().detach()) : item.value().detach();
    }
  };
  auto expectRef = [&](const std::map<std::string, at::Tensor>& got, int step) {
    for (const auto& [name, t] : got)
      EXPECT_CLOSE(t, ref.params.at(name), 0.0, kParamTol) << name << " after step " << step;
  };
  dtp::test::run_ranks(4, [&](int) {
    auto mesh = dtp::init_device_mesh("cpu", {2, 2}, {"pp", "tp"});
    Llama full(c);
    const LlamaPipeline pipe = pipeline_llama(full, mesh, {"1f1b", 2});
    dtp::optim::AdamW opt(pipe.parameters(), torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < 2; ++step) {
      const at::Tensor b = batch(c.vocab_size, step);
      opt.zero_grad();
      pipe.pipeline->step(b.narrow(1, 0, kSeq), b.narrow(1, 1, kSeq));
      opt.step();
    }
    dtp::dcp::StateDict sd = pipe.state_dict(full, &opt);
    sd.metadata["step"] = "2";
    dtp::dcp::save(sd, dir);
  });
  const at::Tensor b = batch(c.vocab_size, 2);
  std::mutex mu;
  std::map<std::string, at::Tensor> got;
  dtp::test::run_ranks(2, [&](int) {  // the whole model, FSDP over dp = 2
    auto mesh = dtp::init_device_mesh("cpu", {2}, {"dp"});
    Llama model(c);
    parallelize_llama(model, mesh);
    dtp::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
    EXPECT_EQ(dtp::dcp::load_state(dir, *model, &opt, llama_state_dict_options()).at("step"), "2");
    const at::Tensor mine = b.narrow(0, mesh.get_local_rank(0) * kBatch / 2, kBatch / 2);
    opt.zero_grad();
    at::Tensor loss = llama_loss(model(mine.narrow(1, 0, kSeq)), mine.narrow(1, 1, kSeq));
    loss.backward();
    opt.step();
    std::map<std::string, at::Tensor> all;
    ownParams(model, model->parameters(), all);
    std::lock_guard<std::mutex> lock(mu);
    got = all;
  });
  EXPECT_EQ(got.size(), ref.params.size());
  expectRef(got, 3);
  for (int pp : {2, 4}) {
    SCOPED_TRACE("pp " + std::to_string(pp));
    got.clear();
    dtp::test::run_ranks(pp, [&](int) {
      auto mesh = dtp::init_device_mesh("cpu", {pp}, {"pp"});
      Llama full(c);
      PipelineOptions po{"gpipe", 4};
      if (pp == 2) po.split = {0, 1};
      const LlamaPipeline pipe = pipeline_llama(full, mesh, po);
      dtp::optim::AdamW opt(pipe.parameters(), torch::optim::AdamWOptions(1e-2));
      EXPECT_EQ(pipe.load_state(dir, full, &opt).at("step"), "2");
      opt.zero_grad();
      at::Tensor loss = pipe.pipeline->step(b.narrow(1, 0, kSeq), b.narrow(1, 1, kSeq));
      opt.step();
      if (loss.defined()) EXPECT_NEAR(loss.item<double>(), ref.losses[2], kLossTol);
      std::map<std::string, at::Tensor> mine;
      ownParams(full, pipe.parameters(), mine);
      std::lock_guard<std::mutex> lock(mu);
      got.insert(mine.begin(), mine.end());
    });
    EXPECT_EQ(got.size(), ref.params.size());
    expectRef(got, 3);
  }
}

TEST(PipelineTest, CompositionErrorsNameTheFix) {
  const LlamaConfig c = config(2);
  dtp::test::run_ranks(2, [&](int) {
    Llama full(c);
    auto pp = dtp::init_device_mesh("cpu", {2}, {"pp"});
    auto tp = dtp::init_device_mesh("cpu", {2}, {"tp"});
    expect_error([&] { pipeline_llama(full, tp, {}); }, "has no \"pp\" dimension");
    expect_error([&] { parallelize_llama(full, pp); }, "Cut the model into stages with pipeline_llama");
    expect_error([&] { pipeline_llama(full, pp, {"1f1b", 1}); }, "1F1B needs at least as many microbatches as stages");
    expect_error([&] { pipeline_llama(full, pp, {"zigzag", 2}); }, "unknown schedule 'zigzag'");
    expect_error([&] { pipeline_llama(full, pp, {"1f1b", 2, 2}); }, "needs the interleaved schedule");
  });
}

TEST(PipelineTest, BadSplitsAndStagesAreNamedErrors) {
  Llama full(config(3));
  expect_error([&] { llama_pipeline_stage(full, 0, 2); }, "3 layers do not divide evenly across 2 stages");
  EXPECT_EQ(llama_pipeline_stage(full, 1, 2, {0, 2})->layers->size(), 1u);  // a user split
  expect_error([&] { Schedule::one_f_one_b(4, 2); }, "1F1B needs at least as many microbatches as stages");
  dtp::test::run_ranks(2, [&](int rank) {
    auto pg = dtp::default_process_group();
    auto loss = [](const at::Tensor& y, const at::Tensor&) { return y.sum(); };
    expect_error([&] { Pipeline(Schedule::gpipe(4, 4), {}, pg, loss); }, "the pp group has 2");
    expect_error([&] { Pipeline(Schedule::gpipe(2, 4), {{1 - rank, [](const at::Tensor& x) { return x; }, {}}}, pg, loss); },
                "runs on pp rank");
    // Stage 1 expects [1, 3] per microbatch; stage 0 sends [1, 4].
    std::vector<PipelineStage> st;
    if (rank == 0) st.push_back({0, [](const at::Tensor& x) { return x * 2; }, {}});
    else st.push_back({1, [](const at::Tensor& x) { return x * 3; }, {1, 3}});
    Pipeline pipe(Schedule::gpipe(2, 2), st, pg, loss);
    at::Tensor in = at::ones({2, 4}, at::kDouble).requires_grad_(false);
    expect_error([&] { Pipeline(Schedule::gpipe(2, 3), st, pg, loss).step(in, in); },
                "cannot be split into 3 equal microbatches");
    if (rank == 1) {
      expect_error([&] { pipe.step(in, in); }, "stage 1 expects inputs of [1, 3] per microbatch, but stage 0 (pp rank 0) "
                                              "sends [1, 4]");
    } else {
      try {  // rank 0 is left waiting for a gradient that never comes: a named p2p failure
        pipe.step(in, in);
        ADD_FAILURE() << "stage 0 should fail without its gradient";
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find("recv of message #1 from global rank 1 to global rank 0"), std::string::npos)
            << e.what();
      }
    }
  }, std::chrono::seconds(3));
}

// NOTE: [Pipeline boundaries]: each step tells its boundary shapes, so a
// step at a larger batch than the first (which aborted inside Gloo) and one
// whose tokens have another shape with the same element count (which reused
// step one's shapes: a wrong loss) both equal the plain computation.
TEST(PipelineTest, StepsOfOtherShapesRenegotiateTheBoundaries) {
  dtp::test::run_ranks(2, [&](int rank) {
    auto pg = dtp::default_process_group();
    const at::Tensor w = at::ones({}, at::kDouble).requires_grad_();  // a parameter: stage 0 has a backward
    std::vector<PipelineStage> st;
    if (rank == 0) st.push_back({0, [&](const at::Tensor& x) { return x * 2 * w; }, {}});
    else st.push_back({1, [](const at::Tensor& x) { return x * 3; }, {}});
    Pipeline pipe(Schedule::gpipe(2, 2), st, pg,
                  [](const at::Tensor& y, const at::Tensor& t) { return (y * t).sum(); });
    for (const auto& shape : std::vector<std::vector<int64_t>>{{2, 4}, {6, 4}, {4, 2}, {2, 3, 5}}) {
      const at::Tensor in = at::arange(2.0, 2.0 + at::empty(shape).numel(), at::kDouble).reshape(shape);
      const at::Tensor t = in.flip(0) + 1;
      at::Tensor loss = pipe.step(in, t);
      if (rank == 1) {
        const double want = (in * 6 * t).sum().item<double>() / 2;
        EXPECT_NEAR(loss.item<double>(), want, 1e-12 * std::abs(want)) << "inputs " << c10::IntArrayRef(shape);
      }
    }
  });
}

// Pipeline set-up is checked across the pp ranks: other microbatch counts
// (which stalled until DTP_TIMEOUT_S) are named with each rank's schedule,
// and a schedule that would deadlock is refused by the constructor.
TEST(PipelineTest, SetUpThatCannotRunIsRefusedAtConstruction) {
  using A = dtp::pp::Action;
  dtp::test::run_ranks(2, [&](int rank) {
    auto pg = dtp::default_process_group();
    auto loss = [](const at::Tensor& y, const at::Tensor&) { return y.sum(); };
    const std::vector<PipelineStage> st{{rank, [](const at::Tensor& x) { return x * 2; }, {}}};
    expect_error([&] { Pipeline(Schedule::gpipe(2, rank == 0 ? 2 : 4), st, pg, loss); },
                 {"Pipeline: the ranks passed different schedules", "GPipe: 2 stages, 2 microbatches",
                  "GPipe: 2 stages, 4 microbatches"});
    const Schedule deadlock("custom", 2, 2,
                            {{{A::Forward, 0, 0}, {A::Backward, 0, 0}, {A::Forward, 0, 1}, {A::Backward, 0, 1}},
                             {{A::Forward, 1, 0}, {A::Forward, 1, 1}, {A::Backward, 1, 0}, {A::Backward, 1, 1}}});
    expect_error([&] { Pipeline(deadlock, st, pg, loss); }, "the ranks would deadlock: rank 0 at 0B0, rank 1 at 1F1");
  }, std::chrono::seconds(10));
}

}  // namespace
