// DTensor per-op overhead against the plain op (Google Benchmark).
//
// Every benchmark comes as a pair on identical local shapes:
//   BM_<Op>/plain    the ATen op on plain CPU tensors of the local shard's shape,
//   BM_<Op>/dtensor  the same op on DTensors (dispatch, cached sharding
//                    propagation, unwrap, local op, wrap).
// The difference is dtp's overhead; a summary table of it is printed at the end.
//
// NOTE: [Bench mesh]
// The mesh is 1-D with 2 ranks, as 2 threads over an in-process HashStore.
// Rank 0 runs the benchmarks; rank 1 only takes part in creating the groups
// and then waits for the end. The placements are chosen so that no rule asks
// for a collective (S(0)+S(0), S(0)xR, views, in-place; AddRedistribute's R
// input is chunked locally), so the difference is the pure dispatch +
// propagation (+ local redistribution) cost. Each
// DTensor benchmark checks that with a CommCounter and fails if one does.
// Why 2 ranks: shards, costs and decisions are then those of a sharded run (on
// one rank every placement holds the whole tensor).
//
// BM_CacheMiss* empty the per-thread propagation cache before every call, so
// each one pays for computing the decision: output shapes on meta tensors,
// rule strategy, cost choice. (The plain variant empties it too.)
#include <dtp/comm_counter.h>
#include <dtp/device_mesh.h>
#include <dtp/dtensor.h>
#include <dtp/explicit_redistribute.h>
#include <dtp/module_utils.h>
#include <dtp/nn/modules.h>
#include <dtp/process_group.h>

#include "dtensor/sharding_prop.h"  // clear_propagation_cache

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <benchmark/benchmark.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <cstdio>
#include <functional>
#include <future>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace {

using Inputs = std::vector<at::Tensor>;

dtp::DeviceMesh& mesh() {
  static dtp::DeviceMesh m;
  return m;
}

// The DTensor of a random global tensor of `shape` with `p` (each rank takes
// its own chunk, no communication), or, for the plain variant, a contiguous
// plain tensor of rank 0's local shape.
at::Tensor make(bool dtensor, at::IntArrayRef shape, dtp::Placement p) {
  at::Tensor d = dtp::distribute_tensor(at::randn(shape), mesh(), {p}, std::nullopt);
  return dtensor ? d : dtp::to_local(d).clone();
}

// Runs `fn` once under a CommCounter; the error, if it communicated or threw.
std::string checkNoComm(const std::function<void()>& fn) {
  try {
    dtp::CommCounter comm;
    fn();
    if (comm.total_count() > 0) return "issued collectives: " + comm.str();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Registers BM_<name>/plain and BM_<name>/dtensor. `setup` builds the inputs
// once per run; `op` is what one iteration times. The DTensor variant is
// labelled with the spec of its result, so the placements are on record.
void pair(const std::string& name, std::function<Inputs(bool dtensor)> setup,
          std::function<at::Tensor(const Inputs&)> op) {
  for (bool dtensor : {false, true}) {
    benchmark::RegisterBenchmark(
        ("BM_" + name + (dtensor ? "/dtensor" : "/plain")).c_str(),
        [=](benchmark::State& state) {
          const Inputs in = setup(dtensor);
          at::Tensor out;
          // Warms the propagation cache (See NOTE: [Bench mesh]).
          const std::string error = checkNoComm([&] { out = op(in); });
          if (!error.empty()) return state.SkipWithError(error.c_str());
          if (dtensor) state.SetLabel(dtp::dtensor_spec(out).str());
          for (auto _ : state) {
            out = op(in);
            benchmark::DoNotOptimize(out.unsafeGetTensorImpl());
          }
        })
        ->Unit(benchmark::kMicrosecond);
  }
}

// The miss path: the next DTensor op computes its decision afresh.
double missNext() {
  dtp::clear_propagation_cache();
  return 1.0;
}

// Linear(64, 64) with weight and bias Shard(0) (column-wise) on a replicated
// [8, 64] input: forward, then backward from an S(1) gradient of the output.
// The plain variant is rank 0's part: Linear(64, 32), gradient [8, 32].
struct LinearStep {
  torch::nn::Linear lin{nullptr};
  at::Tensor x, grad;

  explicit LinearStep(bool dtensor) {
    at::manual_seed(0);
    lin = torch::nn::Linear(64, dtensor ? 64 : 32);
    x = make(dtensor, {8, 64}, dtp::Replicate());
    grad = make(dtensor, {8, 64}, dtp::Shard(1));
    if (dtensor) {
      for (const char* n : {"weight", "bias"}) {
        at::Tensor p = lin->named_parameters()[n];
        dtp::set_parameter(*lin, n, dtp::distribute_tensor(p.detach().requires_grad_(), mesh(),
                                                           {dtp::Shard(0)}, std::nullopt));
      }
    }
  }
  at::Tensor operator()() {
    lin->zero_grad(/*set_to_none=*/true);
    at::Tensor y = lin(x);
    y.backward(grad);
    return y;
  }
};

// Counts the ATen ops that reach dtp with a DTensor argument: dispatcher
// calls with a DTensor input whose op is not CompositeImplicitAutograd
// (those decompose above dtp, into ops that are counted themselves).
int64_t dtensor_op_count = 0;
std::unique_ptr<at::ObserverContext> countDTensorOp(const at::RecordFunction& fn) {
  auto name = fn.operator_name();
  if (!name) return nullptr;
  auto op = c10::Dispatcher::singleton().findOp(*name);
  if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd))
    return nullptr;
  for (const auto& v : fn.inputs()) {
    if ((v.isTensor() && dtp::is_dtensor(v.toTensor())) ||
        (v.isTensorList() && !v.toTensorList().empty() &&
         dtp::is_dtensor(v.toTensorList().get(0)))) {
      ++dtensor_op_count;
      break;
    }
  }
  return nullptr;
}

// The number of ATen ops with a DTensor argument that `fn` runs.
int64_t countDTensorOps(const std::function<void()>& fn) {
  dtensor_op_count = 0;
  auto handle = at::addThreadLocalCallback(at::RecordFunctionCallback(&countDTensorOp)
                                               .needsInputs(true)
                                               .scopes({at::RecordScope::FUNCTION}));
  fn();
  at::removeCallback(handle);
  return dtensor_op_count;
}

void registerBenchmarks() {
  using dtp::Replicate;
  using dtp::Shard;

  // Shapes are global; rank 0's local shapes (those of the plain variants)
  // are in the comments.
  // (1) a small pointwise op: S(0) + S(0) -> S(0), local [8,8] + [8,8].
  pair("Add", [](bool d) { return Inputs{make(d, {16, 8}, Shard(0)), make(d, {16, 8}, Shard(0))}; },
       [](const Inputs& in) { return at::add(in[0], in[1]); });
  // (1b) a pointwise op whose input needs a redistribution on every (cached)
  // call: S(0) + R -> S(0), the R input chunked locally to S(0) (a plan of
  // one local step, no collective); local [8,8] + [8,8] after the chunk.
  pair("AddRedistribute",
       [](bool d) { return Inputs{make(d, {16, 8}, Shard(0)), make(d, {16, 8}, d ? Replicate() : Shard(0))}; },
       [](const Inputs& in) { return at::add(in[0], in[1]); });
  // (2) mm: S(0) x R -> S(0), local [64,64] x [64,64].
  pair("Mm",
       [](bool d) { return Inputs{make(d, {128, 64}, Shard(0)), make(d, {64, 64}, Replicate())}; },
       [](const Inputs& in) { return at::mm(in[0], in[1]); });
  // (3) views of an S(0) tensor, local [8,8]: split the last dim, flatten,
  // transpose (-> S(1)).
  pair("View", [](bool d) { return Inputs{make(d, {16, 8}, Shard(0))}; },
       [](const Inputs& in) { return in[0].view({in[0].size(0), 2, 4}); });
  pair("Reshape", [](bool d) { return Inputs{make(d, {16, 8}, Shard(0))}; },
       [](const Inputs& in) { return in[0].reshape({-1}); });
  pair("Transpose", [](bool d) { return Inputs{make(d, {16, 8}, Shard(0))}; },
       [](const Inputs& in) { return in[0].transpose(0, 1); });
  // (4) in-place: relu_ on S(0), local [8,8]; returns the input DTensor itself.
  pair("Relu_", [](bool d) { return Inputs{make(d, {16, 8}, Shard(0))}; },
       [](const Inputs& in) { return in[0].relu_(); });
  // (5) decode, under NoGradGuard as generate() runs: the replicated [1, 1, 64]
  // residual stream through a column-wise linear as libtorch's Linear computes
  // it, x.matmul(w.t()) (local [1, 1, 64] x [32, 64]^T; two DTensor ops, NOTE:
  // [Fused ops without autograd]), and through RMS norm's six ops.
  pair("DecodeLinear",
       [](bool d) { return Inputs{make(d, {1, 1, 64}, Replicate()), make(d, {64, 64}, Shard(0))}; },
       [](const Inputs& in) {
         at::NoGradGuard no_grad;
         return in[0].matmul(in[1].t());
       });
  pair("DecodeRmsNorm", [](bool d) { return Inputs{make(d, {1, 1, 64}, Replicate()), make(d, {64}, Replicate())}; },
       [](const Inputs& in) {
         at::NoGradGuard no_grad;
         return in[0] * at::rsqrt(in[0].pow(2).mean(-1, true) + 1e-5) * in[1];
       });
  // (6) Linear forward + backward. The DTensor runs of (6) and (7) are
  // labelled with the number of ATen ops that reach dtp per step, to turn the
  // total into a per-op cost.
  for (bool dtensor : {false, true}) {
    benchmark::RegisterBenchmark(
        dtensor ? "BM_LinearFwdBwd/dtensor" : "BM_LinearFwdBwd/plain",
        [dtensor](benchmark::State& state) {
          LinearStep step(dtensor);
          const std::string error = checkNoComm([&] { step(); });
          if (!error.empty()) return state.SkipWithError(error.c_str());
          if (dtensor) {
            const int64_t ops = countDTensorOps([&] { step(); });
            state.SetLabel(std::to_string(ops) + " DTensor ops per step");
          }
          for (auto _ : state) benchmark::DoNotOptimize(step().unsafeGetTensorImpl());
        })
        ->Unit(benchmark::kMicrosecond);
  }

  // (6b) dtp::nn::rms_norm forward + backward on an S(0) [16, 64] input
  // (local [8, 64]) with a replicated weight: one local graph under one
  // DTensor-level node (NOTE: [Fused rms_norm under autograd]); the
  // "Decomposed" pair runs the six ops and their backward as DTensor ops
  // (explicit-redistribution mode turns the fused path off).
  for (bool decomposed : {false, true}) {
    pair(decomposed ? "RmsNormDecomposed" : "RmsNormFwdBwd",
         [](bool d) {
           Inputs in{make(d, {16, 64}, Shard(0)), make(d, {64}, Replicate()), make(d, {16, 64}, Shard(0))};
           in[0].requires_grad_(true);
           in[1].requires_grad_(true);
           return in;
         },
         [decomposed](const Inputs& in) {
           std::optional<dtp::ExplicitRedistributeGuard> guard;
           if (decomposed) guard.emplace();
           at::Tensor y = dtp::nn::rms_norm(in[0], in[1], 1e-5);
           y.backward(in[2]);
           return y;
         });
  }

  // (7) one AdamW step on that Linear's parameters (gradients fixed). Its
  // scalars (the bias-corrected step size) change every step, and scalars are
  // part of the propagation cache key: this shows what that costs.
  for (bool dtensor : {false, true}) {
    benchmark::RegisterBenchmark(
        dtensor ? "BM_AdamWStep/dtensor" : "BM_AdamWStep/plain",
        [dtensor](benchmark::State& state) {
          LinearStep step(dtensor);
          step();
          torch::optim::AdamW opt(step.lin->parameters(), torch::optim::AdamWOptions(1e-3));
          const std::string error = checkNoComm([&] { opt.step(); });
          if (!error.empty()) return state.SkipWithError(error.c_str());
          if (dtensor) {
            const int64_t ops = countDTensorOps([&] { opt.step(); });
            state.SetLabel(std::to_string(ops) + " DTensor ops per step");
          }
          for (auto _ : state) opt.step();
        })
        ->Unit(benchmark::kMicrosecond);
  }

  // (8) cache misses: the same ops with a never-seen alpha each iteration.
  // Last, because every miss adds a cache entry for good: run earlier, the
  // grown cache and heap would slow the benchmarks after them.
  pair("CacheMissAdd",
       [](bool d) { return Inputs{make(d, {16, 8}, Shard(0)), make(d, {16, 8}, Shard(0))}; },
       [](const Inputs& in) { return at::add(in[0], in[1], missNext()); });
  pair("CacheMissAddmm",
       [](bool d) {
         return Inputs{make(d, {64}, Replicate()), make(d, {128, 64}, Shard(0)),
                       make(d, {64, 64}, Replicate())};
       },
       [](const Inputs& in) { return at::addmm(in[0], in[1], in[2], 1.0, missNext()); });
}

// A run that failed or was skipped: Google Benchmark 1.7 (Debian 12) says
// error_occurred, 1.8 and later (Debian 13) say skipped.
template <class Run>
auto failedRun(const Run& r, int) -> decltype(r.error_occurred, bool()) {
  return r.error_occurred;
}
template <class Run>
bool failedRun(const Run& r, long) {
  return r.skipped != decltype(r.skipped){};
}

// Forwards everything to the reporter the flags chose and remembers one time
// per benchmark (the median when --benchmark_repetitions gives one), to print
// the overhead of each /dtensor over its /plain at the end.
class OverheadReporter : public benchmark::BenchmarkReporter {
 public:
  explicit OverheadReporter(benchmark::BenchmarkReporter* inner) : inner_(inner) {}

  bool ReportContext(const Context& context) override {
    inner_->SetOutputStream(&GetOutputStream());
    inner_->SetErrorStream(&GetErrorStream());
    return inner_->ReportContext(context);
  }

  void ReportRuns(const std::vector<Run>& runs) override {
    inner_->ReportRuns(runs);
    for (const auto& r : runs) {
      if (failedRun(r, 0)) continue;
      const bool aggregate = r.run_type == Run::RT_Aggregate;
      if (aggregate && r.aggregate_name != "median") continue;
      std::string name = r.run_name.function_name;
      const auto slash = name.rfind('/');
      if (slash == std::string::npos) continue;
      const std::string variant = name.substr(slash + 1);
      if (variant != "plain" && variant != "dtensor") continue;
      const std::string key = name.substr(0, slash);
      if (entries_.find(key) == entries_.end()) order_.push_back(key);
      auto& e = entries_[key];
      // Medians win over single runs; single runs (no repetitions) are kept.
      Time& t = variant == "plain" ? e.plain : e.dtensor;
      if (aggregate || !t.median) {
        t.us = r.GetAdjustedRealTime() * toMicros(r.time_unit);
        t.cpu_us = r.GetAdjustedCPUTime() * toMicros(r.time_unit);
        t.median = aggregate;
        t.set = true;
      }
    }
  }

  void Finalize() override {
    inner_->Finalize();
    // Only the console format gets the table: it would break JSON or CSV.
    if (dynamic_cast<benchmark::ConsoleReporter*>(inner_) == nullptr) return;
    auto& os = GetOutputStream();
    char line[160];
    os << "\nDTensor overhead (rank 0 of a 2-rank mesh, no communication: dispatch + "
          "propagation;\n real time, and the overhead in CPU time too; medians if repeated)\n";
    std::snprintf(line, sizeof(line), "%-18s %10s %11s %12s %17s\n", "op", "plain us",
                  "dtensor us", "overhead us", "overhead us (cpu)");
    os << line;
    for (const auto& name : order_) {
      const Entry& e = entries_.at(name);
      if (!e.plain.set || !e.dtensor.set) continue;
      std::snprintf(line, sizeof(line), "%-18s %10.2f %11.2f %12.2f %17.2f\n", name.c_str(),
                    e.plain.us, e.dtensor.us, e.dtensor.us - e.plain.us,
                    e.dtensor.cpu_us - e.plain.cpu_us);
      os << line;
    }
  }

 private:
  struct Time {
    double us = 0, cpu_us = 0;
    bool median = false;
    bool set = false;
  };
  struct Entry {
    Time plain, dtensor;
  };
  static double toMicros(benchmark::TimeUnit u) {
    switch (u) {
      case benchmark::kNanosecond: return 1e-3;
      case benchmark::kMicrosecond: return 1.0;
      case benchmark::kMillisecond: return 1e3;
      case benchmark::kSecond: return 1e6;
    }
    return 1.0;
  }

  benchmark::BenchmarkReporter* inner_;
  std::map<std::string, Entry> entries_;
  std::vector<std::string> order_;  // as run
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  // One intra-op thread, as in the tests: the numbers are about per-op
  // overhead, and a 2-core machine makes threaded small ops noisy.
  at::set_num_threads(1);

  // See NOTE: [Bench mesh]. A short timeout: a collective that slipped in
  // fails (and the check reports it) instead of waiting for rank 1.
  auto store = c10::make_intrusive<c10d::HashStore>();
  dtp::ProcessGroupOptions opts;
  opts.backend = "gloo";
  opts.timeout = std::chrono::seconds(20);
  std::promise<void> finished;
  std::thread peer([&, done = finished.get_future()] {
    dtp::set_default_process_group(dtp::ProcessGroup::create(store, /*rank=*/1, /*size=*/2, opts));
    dtp::init_device_mesh("cpu", {2}, {"tp"});
    done.wait();
    dtp::set_default_process_group(dtp::ProcessGroup());
  });
  dtp::set_default_process_group(dtp::ProcessGroup::create(store, /*rank=*/0, /*size=*/2, opts));
  mesh() = dtp::init_device_mesh("cpu", {2}, {"tp"});

  benchmark::AddCustomContext("dtp_mesh", "1-D, 2 ranks as threads; rank 0 measured, no "
                                          "collectives (dispatch + propagation only)");
  benchmark::AddCustomContext("torch_threads", std::to_string(at::get_num_threads()));
  registerBenchmarks();

  OverheadReporter reporter(benchmark::CreateDefaultDisplayReporter());
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  mesh() = dtp::DeviceMesh();
  dtp::set_default_process_group(dtp::ProcessGroup());
  finished.set_value();
  peer.join();
  return 0;
}
