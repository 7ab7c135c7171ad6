// dtp-bench: one training step (forward, backward, AdamW) of the reference
// Llama, side by side in one run on the same machine:
//   (a) dtp: DTensor tensor parallelism via apply_tensor_parallel;
//   (b) hand: hand-written Megatron TP in plain libtorch (megatron.h);
//   (c) single: the unsharded model on rank 0 alone, with all the job's threads.
// Variants run interleaved, rep after rep, so drift hits them alike, each
// rep in a new random order (the same on every rank): with a fixed order, on
// a 2-vCPU VM, a variant ran 5-15% faster or slower depending on which one
// ran before it. Each rep's time is the slowest rank's. --aa adds a second,
// identical hand-written model: its ratio to the first is the noise floor of
// the comparison. Also: collectives per step against the
// closed-form minimum, and memory per rank at TP=1 and TP=N. Exits non-zero
// when the variants' losses or dtp's communication disagree with the theory.
// Run it under the launcher: `dtprun -n 2 dtp-bench`; `-n 1` leaves only
// DTensor's own CPU cost (no communication) between dtp and hand-written.
#include "../common/checks.h"
#include "../common/model_flags.h"
#include "megatron.h"
#include "sizes.h"
#include "stats.h"
#include "ac.h"
#include "async.h"
#include "moe.h"
#include "collectives.h"
#include "decode.h"
#include "device.h"
#include "profile.h"
#include "soak.h"
#include "two_d.h"
#include "memory.h"

#include "dtp/comm_counter.h"
#include "dtp/device_mesh.h"
#include "dtp/dtensor.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/optim/adamw.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/version.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <functional>
#include <map>
#include <numeric>
#include <random>

namespace {

using namespace dtp;
using namespace dtp::models;

using bench::kMiB;
using bench::kSizes;
using bench::median;
using bench::Size;

struct Options {
  std::vector<std::string> sizes{"small", "medium", "large"};
  std::vector<std::string> sp{"on", "off"};
  int reps = 7, warmup = 2;
  int64_t dp = 1;
  bool aa = false, ac = false, decode = false;
  std::string device;
};

using Clock = std::chrono::steady_clock;
constexpr CollectiveType kTypes[] = {CollectiveType::AllReduce, CollectiveType::AllGather,
                                     CollectiveType::ReduceScatter};
const char* kTypeNames[] = {"all_reduce", "all_gather", "reduce_scatter"};

struct Comm {
  int64_t count[3] = {0, 0, 0}, bytes[3] = {0, 0, 0};
};

// The minimum for Megatron TP on a [batch, seq, dim] fp32 residual stream of L
// layers, in CommCounter's terms (an all-gather counts the gathered tensor, a
// reduce-scatter its input, an all-reduce its tensor):
// - without SP: all-reduces of the embedding, 2 per layer and 3 [batch*seq]
//   for the loss forward; 2 per layer and 1 for the head's input backward.
// - with SP: 2L+1 all-gathers and 2L+1 reduce-scatters each way (the
//   embedding's reduce-scatter, 2 per layer, the head's gather), the loss's 3
//   all-reduces, and one all-reduce of the 2L+1 norm weights' gradients.
// - on one rank: nothing.
Comm theory(const LlamaConfig& c, int64_t batch, int64_t seq, bool sp, int tp) {
  const int64_t act = batch * seq * c.dim * 4, loss = 3 * batch * seq * 4, l = c.n_layers;
  Comm t;
  if (tp == 1) return t;
  if (sp) {
    for (int i : {1, 2}) {
      t.count[i] = 2 * (2 * l + 1);
      t.bytes[i] = t.count[i] * act;
    }
    t.count[0] = 3 + 1;
    t.bytes[0] = loss + (2 * l + 1) * c.dim * 4;
  } else {
    t.count[0] = (1 + 2 * l + 3) + (2 * l + 1);
    t.bytes[0] = (1 + 2 * l + 2 * l + 1) * act + loss;
  }
  return t;
}

Comm measured(const CommCounter& counter) {
  Comm m;
  for (int i = 0; i < 3; ++i) {
    m.count[i] = counter.count(kTypes[i]);
    m.bytes[i] = counter.bytes(kTypes[i]);
  }
  return m;
}

// One model under test.
struct Variant {
  std::string name;
  bool sp = false, all_ranks = true;
  std::function<at::Tensor()> loss;
  std::function<void()> after_backward = [] {};
  std::unique_ptr<torch::optim::AdamW> opt;
  std::vector<at::Tensor> params;
  std::vector<double> ms;
  std::vector<double> cpu_ms;  // CPU time of all ranks' processes (every thread)
  double first_loss = 0;
  Comm comm;
  bench::ModelMemory memory;

  int64_t activations = 0;  // bytes live at the end of the last forward, beyond what lived before it

  double step() {
    opt->zero_grad();
    const int64_t before = bench::live_bytes();
    at::Tensor l = loss();
    activations = bench::live_bytes() - before;
    l.backward();
    after_backward();
    opt->step();
    return l.item<double>();
  }
};

double cpuMs() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

struct SizeReport {
  const Size* size;
  int64_t n_params;
  std::vector<Variant> variants;
  std::map<bool, Comm> theory;
};

// Runs every variant of one size; returns false when a check failed.
bool runSize(const Size& s, const Options& o, const ProcessGroup& world, const DeviceMesh& mesh,
             SizeReport& report) {
  const LlamaConfig c = s.config();
  const int rank = world.rank(), tp = world.size();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor batch = at::randint(c.vocab_size, {s.batch, s.seq + 1}, gen);
  const at::Tensor tokens = batch.narrow(1, 0, s.seq), targets = batch.narrow(1, 1, s.seq);
  const auto adamw = [](const std::vector<at::Tensor>& p) {
    return std::make_unique<dtp::optim::AdamW>(p, torch::optim::AdamWOptions(1e-3));
  };

  report.size = &s;
  auto& vs = report.variants;
  auto add = [&](const char* name, bool sp, std::vector<at::Tensor> params, std::function<at::Tensor()> loss) {
    Variant& v = vs.emplace_back();
    v.name = name;
    v.sp = sp;
    v.params = std::move(params);
    v.loss = std::move(loss);
    return &v;
  };
  for (const auto& mode : o.sp) {
    const bool sp = mode == "on";
    report.theory[sp] = theory(c, s.batch, s.seq, sp, tp);
    Llama dm(c);
    apply_tensor_parallel(dm, mesh, TensorParallelOptions{sp, s.seq});
    add("dtp", sp, dm->unique_parameters(),
        [dm, tokens, targets]() mutable { return llama_loss(dm(tokens), targets); });
    auto hand = std::make_shared<bench::MegatronLlama>(Llama(c), world, sp);
    add("hand", sp, hand->parameters(), [hand, tokens, targets] { return hand->loss(tokens, targets); })
        ->after_backward = [hand] { hand->reduce_norm_grads(); };
    if (o.aa) {
      auto again = std::make_shared<bench::MegatronLlama>(Llama(c), world, sp);
      add("hand'", sp, again->parameters(), [again, tokens, targets] { return again->loss(tokens, targets); })
          ->after_backward = [again] { again->reduce_norm_grads(); };
    }
  }
  Llama single(c);
  report.n_params = 0;
  for (const auto& p : single->unique_parameters()) report.n_params += p.numel();
  add("single", false, single->unique_parameters(),
      [single, tokens, targets]() mutable { return llama_loss(single(tokens), targets); })
      ->all_ranks = false;
  for (auto& v : vs) v.opt = adamw(v.params);

  const int threads = at::get_num_threads();
  std::vector<size_t> order(vs.size());
  std::iota(order.begin(), order.end(), 0);
  std::mt19937 shuffler(7);  // one seed: the same orders on every rank
  for (int r = 0; r < o.warmup + o.reps; ++r) {
    std::shuffle(order.begin(), order.end(), shuffler);
    for (size_t k : order) {
      Variant& v = vs[k];
      world.barrier();
      const double cpu0 = cpuMs();
      const auto t0 = Clock::now();
      if (v.all_ranks || rank == 0) {
        if (!v.all_ranks) at::set_num_threads(threads * tp);
        CommCounter counter;
        const double loss = v.step();
        if (r == 0) v.first_loss = loss;
        if (r == o.warmup) v.comm = measured(counter);
        at::set_num_threads(threads);
      }
      at::Tensor ms = at::full({1}, std::chrono::duration<double, std::milli>(Clock::now() - t0).count(),
                               at::kDouble);
      at::Tensor cpu = at::full({1}, cpuMs() - cpu0, at::kDouble);
      world.all_reduce(ms, ReduceOp::Max);
      world.all_reduce(cpu);
      if (r >= o.warmup) {
        v.ms.push_back(ms.item<double>());
        v.cpu_ms.push_back(cpu.item<double>());
      }
    }
  }
  // Memory after the last timed step (steady state).
  for (auto& v : vs) {
    if (!v.all_ranks && rank != 0) continue;
    v.memory = bench::state_memory(v.params, *v.opt);
    v.memory.activations = v.activations;
  }

  bool ok = true;
  const double want = vs.back().first_loss;
  at::Tensor ref = at::full({1}, rank == 0 ? want : 0.0, at::kDouble);
  world.all_reduce(ref);  // rank 0's single-device loss, everywhere
  for (auto& v : vs) {
    if (v.all_ranks && std::abs(v.first_loss - ref.item<double>()) > 1e-4) {
      std::fprintf(stderr, "dtp-bench: %s (%s SP) first loss %.6f differs from the single device's %.6f\n",
                   v.name.c_str(), v.sp ? "with" : "without", v.first_loss, ref.item<double>());
      ok = false;
    }
    // Both the hand-written step (which checks the formula) and dtp must
    // meet the theory exactly, in count and bytes.
    if (v.all_ranks) {
      const Comm& t = report.theory[v.sp];
      for (int i = 0; i < 3; ++i) {
        if (v.comm.bytes[i] != t.bytes[i] || v.comm.count[i] != t.count[i]) {
          std::fprintf(stderr, "dtp-bench: %s %s, %s SP: %lld %s moving %lld bytes; theory %lld moving %lld\n",
                       s.name, v.name.c_str(), v.sp ? "with" : "without", static_cast<long long>(v.comm.count[i]),
                       kTypeNames[i], static_cast<long long>(v.comm.bytes[i]), static_cast<long long>(t.count[i]),
                       static_cast<long long>(t.bytes[i]));
          ok = false;
        }
      }
    }
  }
  return ok;
}

std::string spName(bool sp) { return sp ? "yes" : "no"; }

void printReports(const std::vector<SizeReport>& reports, const Options& o, int tp) {
  const size_t group = o.aa ? 3 : 2;  // variants per SP setting: dtp, hand-written (and hand')
  const char* shm = std::getenv("DTP_SHM");
  std::printf("\n## Step time, median of %d reps (ms); TP=%d, CPU collectives over %s; single = rank 0 with %d "
              "threads\n\n", o.reps, tp, shm != nullptr && std::string(shm) == "0" ? "Gloo (DTP_SHM=0)"
              : "shared memory up to DTP_SHM_MAX_BYTES where ranks share a host, else Gloo", at::get_num_threads() * tp);
  std::printf("| size | params | SP | dtp | hand-written | single | dtp / hand | dtp / hand, paired | dtp / single |%s\n",
              o.aa ? " hand' / hand (A/A) | A/A, paired |" : "");
  std::printf("|---|---|---|---|---|---|---|---|---|%s\n", o.aa ? "---|---|" : "");
  // The median of per-rep ratios: one rep's variants run close together, so
  // this cancels drift that a ratio of medians keeps.
  auto paired = [](const Variant& a, const Variant& b) {
    std::vector<double> q;
    for (size_t k = 0; k < a.ms.size(); ++k) q.push_back(a.ms[k] / b.ms[k]);
    return median(q);
  };
  for (const auto& r : reports) {
    const double single = median(r.variants.back().ms);
    for (size_t i = 0; i + 1 < r.variants.size(); i += group) {
      const Variant &va = r.variants[i], &vb = r.variants[i + 1];
      const double a = median(va.ms), b = median(vb.ms);
      std::printf("| %s | %.2fM | %s | %.2f | %.2f | %.2f | %.3f | %.3f | %.3f |", r.size->name, r.n_params / 1e6,
                  spName(va.sp).c_str(), a, b, single, a / b, paired(va, vb), a / single);
      if (o.aa) {
        const Variant& again = r.variants[i + 2];
        std::printf(" %.3f | %.3f |", median(again.ms) / b, paired(again, vb));
      }
      std::printf("\n");
    }
  }
  // CPU time does not count waiting, so it is steadier than the step time on
  // a shared machine; with the same collectives, dtp - hand is DTensor's cost.
  std::printf("\n## CPU time per step, all ranks and threads, median of %d reps (ms)\n\n", o.reps);
  std::printf("| size | SP | dtp | hand-written | dtp - hand | dtp / hand |%s\n", o.aa ? " hand' / hand (A/A) |" : "");
  std::printf("|---|---|---|---|---|---|%s\n", o.aa ? "---|" : "");
  for (const auto& r : reports) {
    for (size_t i = 0; i + 1 < r.variants.size(); i += group) {
      const double a = median(r.variants[i].cpu_ms), b = median(r.variants[i + 1].cpu_ms);
      std::printf("| %s | %s | %.2f | %.2f | %.2f | %.3f |", r.size->name, spName(r.variants[i].sp).c_str(), a, b,
                  a - b, a / b);
      if (o.aa) std::printf(" %.3f |", median(r.variants[i + 2].cpu_ms) / b);
      std::printf("\n");
    }
  }
  std::printf("\n## Collectives per step: count and MiB per rank (theory / dtp / hand-written)\n\n");
  std::printf("| size | SP | collective | theory | dtp | hand | dtp / theory (bytes) |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (const auto& r : reports) {
    for (size_t i = 0; i + 1 < r.variants.size(); i += group) {
      const Variant &a = r.variants[i], &b = r.variants[i + 1];
      const Comm& t = r.theory.at(a.sp);
      for (int k = 0; k < 3; ++k) {
        if (t.count[k] == 0 && a.comm.count[k] == 0) continue;
        std::printf("| %s | %s | %s | %lld, %.3f | %lld, %.3f | %lld, %.3f | %.3f |\n", r.size->name,
                    spName(a.sp).c_str(), kTypeNames[k], static_cast<long long>(t.count[k]), t.bytes[k] / kMiB,
                    static_cast<long long>(a.comm.count[k]), a.comm.bytes[k] / kMiB,
                    static_cast<long long>(b.comm.count[k]), b.comm.bytes[k] / kMiB,
                    t.bytes[k] ? static_cast<double>(a.comm.bytes[k]) / t.bytes[k] : 0.0);
      }
    }
  }
  std::printf("\n## Memory per rank (MiB): TP=1 vs dtp TP=%d; sharded part's ratio (ideal 1/%d = %.3f)\n\n", tp, tp,
              1.0 / tp);
  std::printf("| size | SP | params TP=1 / TP=%d | ratio | grads | ratio | AdamW state | ratio | activations TP=1 / TP=%d |\n",
              tp, tp);
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& r : reports) {
    const bench::ModelMemory& one = r.variants.back().memory;
    for (size_t i = 0; i + 1 < r.variants.size(); i += group) {
      const bench::ModelMemory& m = r.variants[i].memory;
      // Replicated tensors have the same shapes at TP=1: the rest of TP=1 is what TP=N shards.
      auto cell = [](const bench::StateBytes& whole, const bench::StateBytes& part) {
        const double sharded_one = whole.total - part.replicated, sharded = part.total - part.replicated;
        std::printf(" %.2f / %.2f | %.4f |", whole.total / kMiB, part.total / kMiB, sharded / sharded_one);
      };
      std::printf("| %s | %s |", r.size->name, spName(r.variants[i].sp).c_str());
      cell(one.params, m.params);
      cell(one.grads, m.grads);
      cell(one.optimizer, m.optimizer);
      std::printf(" %.2f / %.2f |\n", one.activations / kMiB, m.activations / kMiB);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  bench::install_memory_tracker();
  CLI::App app{"dtp-bench: DTensor tensor parallelism vs hand-written TP vs one rank, one training step"};
  Options o;
  std::vector<std::string> names;
  for (const auto& s : kSizes) names.push_back(s.name);
  app.add_option("--sizes", o.sizes, "Model sizes to run")->check(CLI::IsMember(names))->capture_default_str();
  app.add_option("--sp", o.sp, "Sequence parallelism settings to run")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  app.add_option("--reps", o.reps, "Timed steps per variant")->check(dtp::apps::kPositive)->capture_default_str();
  app.add_option("--warmup", o.warmup, "Untimed steps first")->check(dtp::apps::kNonNegative)->capture_default_str();
  app.add_flag("--aa", o.aa, "Also time a second, identical hand-written model: the comparison's noise floor");
  app.add_flag("--ac", o.ac, "Run the activation-checkpointing table (no AC, full, selective) instead");
  bool async_ab = false;
  app.add_flag("--async", async_ab,
               "Run the async-redistribution table instead: redistribute(async_op=true) vs all synchronous, A B A B, "
               "on the Llama TP step of --sizes and on a step with compute between issue and use");
  bool moe = false;
  app.add_flag("--moe", moe, "Run the mixture-of-experts table instead: one MoE layer, expert parallelism over every "
               "rank vs one device, training and decode, and the dispatch all-to-all");
  app.add_flag("--decode", o.decode,
               "Run the KV-cache decode table (ms per token, dtp vs hand-written, TP=1 and TP=WORLD_SIZE) instead; "
               "--reps and --warmup default to 5 and 1 there");
  bool collectives = false;
  app.add_flag("--collectives", collectives,
               "Run the CPU collectives table (all_reduce, all_gather, reduce_scatter by size; Gloo vs shared memory) "
               "instead");
  bench::CollectiveOptions coll;
  app.add_option("--bytes", coll.sizes, "Message sizes --collectives runs")->check(dtp::apps::kPositive);
  bench::DecodeOptions decode;
  app.add_option("--decode-sizes", decode.sizes, "Model sizes --decode runs")
      ->check(CLI::IsMember(bench::decode_size_names()))
      ->capture_default_str();
  app.add_option("--batches", decode.batches, "Batch sizes --decode runs")
      ->check(dtp::apps::kPositive)
      ->capture_default_str();
  // --decode's weights, parsed as dtp-generate's (apps/common/model_flags.h).
  dtp::apps::ModelFlags decode_weights;
  dtp::apps::add_weight_format_flags(app, decode_weights);
  app.add_option("--dp", o.dp, "Data-parallel degree: run the 2-D (dp, WORLD_SIZE/dp) tables (FSDP, DDP) instead")
      ->check(dtp::apps::kPositive);
  app.add_option("--device", o.device, "Run the dtp vs plain libtorch table on this device instead (cuda: GPU LOCAL_RANK); with --decode, "
                 "the device the decode table runs on")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  int64_t soak_steps = 0;
  app.add_option("--soak", soak_steps,
                 "Run this many training steps, then decode steps, of a small Llama under TP; report memory, the "
                 "decision cache's size and the step time at intervals; fail when one grows")
      ->check(dtp::apps::kPositive);
  std::string profile_dir;
  app.add_option("--profile", profile_dir,
                 "With --device: also profile one step of each variant (libtorch 2.x's Kineto): Chrome traces in this "
                 "folder and tables of the top host ops")
      ->needs("--device");
  CLI11_PARSE(app, argc, argv);

  if (!profile_dir.empty() && !bench::can_profile()) {
    std::fprintf(stderr, "dtp-bench: --profile needs libtorch 2.x (Kineto's C++ API); this is libtorch %s\n", TORCH_VERSION);
    return 2;
  }
  try {
    if (!profile_dir.empty()) std::filesystem::create_directories(profile_dir);
    ProcessGroup world = init_process_group();
    if (soak_steps > 0) {
      const bool ok = bench::run_soak(soak_steps, world);
      if (world.rank() == 0) std::printf(ok ? "\ndtp-bench --soak: flat\n" : "\ndtp-bench --soak: GREW (see above)\n");
      std::fflush(stdout);
      return ok ? 0 : 1;
    }
    if (moe) {
      const bool ok = bench::run_moe(o.reps, o.warmup, world);
      if (world.rank() == 0) std::printf(ok ? "\ndtp-bench --moe: checks passed (EP equals one device)\n"
                                            : "\ndtp-bench --moe: CHECKS FAILED (see above)\n");
      std::fflush(stdout);
      return ok ? 0 : 1;
    }
    if (collectives) {
      if (app.count("--reps") > 0) coll.reps = o.reps;
      const bool ok = bench::run_collectives(coll, world);
      if (world.rank() == 0)
        std::printf(ok ? "dtp-bench --collectives: checks passed (both paths give the same results)\n"
                       : "dtp-bench --collectives: CHECKS FAILED (see above)\n");
      std::fflush(stdout);
      return ok ? 0 : 1;
    }
    if (o.decode) {
      TORCH_CHECK(profile_dir.empty(), "dtp-bench: --profile profiles the --device table, not --decode.");
      if (!o.device.empty()) decode.device = o.device;
      if (app.count("--reps") > 0) decode.reps = o.reps;
      if (app.count("--warmup") > 0) decode.warmup = o.warmup;
      decode.dtype = dtp::apps::dtype_of(decode_weights.dtype);
      decode.weight_only = dtp::apps::weight_only_of(decode_weights);
      decode.weights = decode_weights.quantize != "none"
                           ? decode_weights.quantize + " (groups of " + std::to_string(decode_weights.quantize_group) +
                                 ", " + decode_weights.quantize_scales + " scales)"
                           : decode_weights.dtype;
      if (world.rank() == 0)
        std::printf("dtp-bench --decode: %d ranks, %d threads per rank, libtorch %s\n", world.size(),
                    at::get_num_threads(), TORCH_VERSION);
      const bool ok = bench::run_decode(decode, world);
      std::fflush(stdout);
      return ok ? 0 : 1;
    }
    if (async_ab) {
      std::vector<const Size*> sizes;
      for (const auto& name : o.sizes)
        sizes.push_back(&*std::find_if(std::begin(kSizes), std::end(kSizes), [&](const Size& x) { return name == x.name; }));
      if (world.rank() == 0)
        std::printf("dtp-bench --async: %d ranks, libtorch %s\n", world.size(), TORCH_VERSION);
      const bool ok = bench::run_async(sizes, o.reps, o.warmup, world);
      if (world.rank() == 0)
        std::printf(ok ? "\ndtp-bench --async: checks passed (same losses and collectives)\n"
                       : "\ndtp-bench --async: CHECKS FAILED (see above)\n");
      std::fflush(stdout);
      return ok ? 0 : 1;
    }
    if (o.dp > 1 || o.ac || !o.device.empty()) {
      std::vector<const Size*> sizes;
      for (const auto& name : o.sizes)
        sizes.push_back(&*std::find_if(std::begin(kSizes), std::end(kSizes), [&](const Size& x) { return name == x.name; }));
      if (world.rank() == 0)
        std::printf("dtp-bench: %d ranks, %d threads per rank, libtorch %s\n", world.size(), at::get_num_threads(),
                    TORCH_VERSION);
      std::vector<bool> sps;
      for (const auto& mode : o.sp) sps.push_back(mode == "on");
      const bool ok = !o.device.empty() ? bench::run_device(sizes, o.device, sps, o.reps, o.warmup, world, profile_dir)
                      : o.ac            ? bench::run_ac(sizes, o.reps, o.warmup, world)
                                        : bench::run_two_d(sizes, o.dp, o.reps, o.warmup, world);
      if (world.rank() == 0)
        std::printf(!ok                    ? "\ndtp-bench: CHECKS FAILED (see above)\n"
                    : o.device.empty() && !o.ac ? "\ndtp-bench: checks passed (losses agree; collectives meet the closed form)\n"
                                                : "\ndtp-bench: checks passed (losses agree)\n");
      std::fflush(stdout);
      return ok ? 0 : 1;
    }
    DeviceMesh mesh = init_device_mesh("cpu", {world.size()}, {"tp"});
    if (world.rank() == 0)
      std::printf("dtp-bench: %s, %d threads per rank, libtorch %s\n", mesh.str().c_str(), at::get_num_threads(),
                  TORCH_VERSION);
    bool ok = true;
    std::vector<SizeReport> reports;
    for (const auto& name : o.sizes) {
      const Size& s = *std::find_if(std::begin(kSizes), std::end(kSizes), [&](const Size& x) { return name == x.name; });
      reports.emplace_back();
      ok &= runSize(s, o, world, mesh, reports.back());
      if (world.rank() == 0) std::printf("  %s done\n", s.name);
    }
    if (world.rank() == 0) {
      printReports(reports, o, world.size());
      std::printf(ok ? "\ndtp-bench: checks passed (losses agree; collectives meet the theory)\n"
                     : "\ndtp-bench: CHECKS FAILED (see above)\n");
    }
    std::fflush(stdout);
    return ok ? 0 : 1;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());
    return 2;
  }
}
