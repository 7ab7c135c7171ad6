// dtp-train: trains the reference Llama with tensor parallelism, data
// parallelism (FSDP or DDP), context parallelism and pipeline parallelism on
// a (pp, dp, tp) mesh, or ParallelDims' (dp_shard, cp, tp) one with --cp (with
// --ep: (dp_shard_mod_ep, dp_shard_in_ep, cp, tp), the experts over ep x cp), on
// byte-level English text. Run it under the launcher:
// `dtprun -n 4 dtp-train --dp 2 --tp 2`, `dtprun -n 8 dtp-train --pp 2 --dp 2 --tp 2`,
// `dtprun -n 4 dtp-train --cp 4 --seq 16384`.
#include "../common/checkpoint_flags.h"
#include "../common/corpus.h"
#include "../common/model_flags.h"
#include "../common/parallel_flags.h"
#include "../common/proc_status.h"
#include "metrics.h"
#include "options.h"

#include "comm/compat.h"
#include "dtp/amp/grad_scaler.h"
#include "dtp/amp/mixed_precision.h"
#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/dcp/checkpoint.h"
#include "dtp/models/checkpoint.h"
#include "dtp/models/hf_llama.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/optim/adamw.h"
#include "dtp/optim/clip_grad.h"
#include "dtp/random.h"
#include "dtp/text/tokenizer.h"
#include "dtp/trace.h"

#include <CLI/CLI.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <sstream>

namespace {

using namespace dtp;
using namespace dtp::models;
using apps::train::Options;
using apps::train::add_options;
using apps::train::configOf;
using apps::train::mpPolicy;


// Peak resident memory of this process (VmHWM), MiB.
double peakRssMiB() { return apps::proc_field_kb("/proc/self/status", "VmHWM:") / 1024.0; }

// --metrics of a MoE model: the routed slots per expert of the last forward
// (summed over layers, dp and cp ranks) and the load-balancing loss (averaged
// over dp and cp: each rank's is dp x cp times its share, NOTE in
// moe_load_balancing_loss). Collective over dp and cp: every rank calls it.
void moeMetrics(Llama& model, const at::Tensor& aux, const ProcessGroup& dp, const ProcessGroup& cp,
                apps::StepMetrics& m) {
  const int64_t E = model->config.moe.num_experts;
  at::Tensor counts = at::zeros({E}, at::kLong);
  for (const auto& layer : *model->layers) {
    const auto& moe = layer->as<TransformerBlockImpl>()->moe;
    if (moe && moe->selected.defined()) counts += at::bincount(moe->selected.flatten().cpu(), {}, E);
  }
  at::Tensor a = at::full({1}, aux.defined() ? (is_dtensor(aux) ? full_tensor(aux) : aux).item<double>() : 0.0,
                          at::kDouble);
  for (const ProcessGroup* g : {&dp, &cp}) {
    if (!g->valid()) continue;
    g->all_reduce(counts).wait();
    g->all_reduce(a, ReduceOp::Avg).wait();
  }
  m.tokens_per_expert.assign(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + E);
  m.aux_loss = aux.defined() ? a.item<double>() : std::nan("");
}

// Where the run starts: a checkpoint (a dcp folder that find_checkpoint
// chose, or an earlier dtp's single file), HF weights, or the init. Returns
// the first step.
// The loss scaler's state in a checkpoint's metadata ("grad_scaler"):
// PyTorch's state_dict entries as name=value pairs.
std::string scalerMetadata(const GradScaler& scaler) {
  std::ostringstream out;
  out << std::setprecision(17);  // every double back as it was
  for (const auto& [name, value] : scaler.state_dict()) out << (out.tellp() > 0 ? "," : "") << name << "=" << value;
  return out.str();
}

void loadScaler(const std::string& text, GradScaler& scaler, const std::string& from) {
  std::map<std::string, double> state;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    const size_t eq = item.find('=');
    TORCH_CHECK(eq != std::string::npos, "--resume '", from, "': its grad_scaler metadata '", text, "' is not "
                "name=value pairs: the checkpoint is damaged.");
    state[item.substr(0, eq)] = std::stod(item.substr(eq + 1));
  }
  scaler.load_state_dict(state);
}

int64_t startFrom(const Options& o, Llama& model, const LlamaPipeline* pipe, torch::optim::AdamW& opt,
                  GradScaler& scaler) {
  if (!o.resume.empty()) {
    const bool file = std::filesystem::is_regular_file(o.resume);
    TORCH_CHECK(!file || !pipe, "--resume '", o.resume, "' is a single-file checkpoint of an earlier dtp, which a "
                "pipeline cannot load. Resume it without --pp and --save a folder.");
    if (file) return load_checkpoint(o.resume, model, &opt);
    const auto meta = pipe ? pipe->load_state(o.resume, model, &opt)
                           : dcp::load_state(o.resume, *model, &opt, llama_state_dict_options());
    auto it = meta.find("step");
    TORCH_CHECK(it != meta.end(), "--resume '", o.resume, "' has no \"step\" metadata: it was not written by "
                "dtp-train. Resume from a dtp-train --save folder.");
    // A float16 run's scale goes on from the saved one (a run saved
    // without one starts from the initial scale).
    if (auto s = meta.find("grad_scaler"); s != meta.end() && scaler.is_enabled()) loadScaler(s->second, scaler, o.resume);
    return std::stoll(it->second);
  }
  if (!o.init_from_hf.empty()) load_hf_weights(model, o.init_from_hf);
  return 0;
}

// Bytes of memory available to this process: MemAvailable shared by the
// local ranks.
double availableBytesPerRank(int64_t world) {
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  const int64_t ranks = local != nullptr && std::atoll(local) > 0 ? std::atoll(local) : world;
  return apps::proc_field_kb("/proc/meminfo", "MemAvailable:") * 1024.0 / static_cast<double>(ranks);
}

// A rough lower estimate of one rank's peak memory for a training step:
// parameters, gradients and AdamW's two moments (sharded 1/tp, and 1/dp
// under FSDP), and the activations autograd keeps per layer for this rank's
// batch/dp sequences (about 10 [batch, seq, dim] tensors, 4 of the MLP's
// [batch, seq, hidden/tp], 3 of the attention's [batch, heads/tp, seq, seq])
// plus 3 copies of the logits [batch, seq, vocab/tp].
struct MemoryEstimate {
  double states, activations, scores;
  double total() const { return states + activations; }
};

// Under --cp each rank holds seq/cp positions, and its attention keeps one
// block of scores at a time (ring) instead of every layer's.
MemoryEstimate estimateMemory(const Options& o, int64_t dp, int64_t tp) {
  const LlamaConfig c = configOf(o);
  const double bytes = c10::elementSize(c.dtype), B = static_cast<double>(o.batch) / dp,
               S = static_cast<double>(o.seq) / o.cp, D = c.dim, L = c.n_layers;
  const double params = 2.0 * c.vocab_size * D + L * (D * D * 2 + 2.0 * D * c.n_kv_heads * c.head_dim() +
                                                      3.0 * D * c.hidden());
  MemoryEstimate m;
  m.states = 4 * params / tp / (o.ddp ? 1 : dp * o.cp) * bytes;
  m.scores = (o.cp > 1 ? 1 : L) * 3 * B * (static_cast<double>(c.n_heads) / tp) * S * S * bytes;
  m.activations = L * B * S * (10 * D + 4.0 * c.hidden() / tp) * bytes + m.scores +
                  3 * B * S * (static_cast<double>(c.vocab_size) / tp) * bytes;
  return m;
}

std::string gib(double b) {
  char s[32];
  std::snprintf(s, sizeof(s), "%.2f GiB", b / (1024.0 * 1024 * 1024));
  return s;
}

struct Run {
  std::vector<double> losses;
  int64_t skipped = 0;  // steps GradScaler skipped
  std::vector<std::pair<std::string, at::Tensor>> params;  // full, at the end
};

// Trains `model` from `first` to o.steps; logs on rank 0 when `log`. Under
// data parallelism (`dp` valid) each dp rank trains its batch/dp rows of
// every batch, and the loss reported is their average.
// The learning rate of step `step`: linear warmup over o.warmup steps, then
// constant or a cosine decay to lr/10 at the last step.
double learningRate(const Options& o, int64_t step) {
  if (step < o.warmup) return o.lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup);
  if (o.lr_schedule == "constant") return o.lr;
  const double span = std::max<int64_t>(1, o.steps - o.warmup - 1);
  const double progress = std::min(1.0, static_cast<double>(step - o.warmup) / span);
  return o.lr * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI * progress)));
}

// The whole model's parameters by name (full tensors), on every rank. Under
// a pipeline each comes from the pp rank whose stage holds it.
std::vector<std::pair<std::string, at::Tensor>> fullParams(Llama& model, const LlamaPipeline* pipe,
                                                           const ProcessGroup& pp) {
  std::set<const void*> mine;
  if (pipe)
    for (const auto& p : pipe->parameters()) mine.insert(p.unsafeGetTensorImpl());
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& [name, p] : model->unique_named_parameters()) {
    const bool here = !pipe || mine.count(p.unsafeGetTensorImpl()) > 0;
    at::Tensor t = !here ? at::empty(p.sizes(), p.options().device(model->config.device))
                   : is_dtensor(p) ? full_tensor(p.detach()) : p.detach().clone();
    if (pipe) {
      at::Tensor owner = at::full({1}, here ? pp.rank() : -1, at::kLong);
      pp.all_reduce(owner, ReduceOp::Max);
      pp.broadcast(t, static_cast<int>(owner.item<int64_t>()));
    }
    out.emplace_back(name, t);
  }
  return out;
}

// Under context parallelism (`cp` valid) each cp rank trains its positions of
// those rows (context_parallel_shard_batch), and the loss reported is the
// average over cp too: each rank's loss is weighted by its share of the
// positions (llama_loss(model, ...)), so that average is the whole batch's.
Run train(Llama& model, const LlamaPipeline* pipe, const Options& o, const at::Tensor& corpus, bool log,
          const ProcessGroup& world, const ProcessGroup& dp, const ProcessGroup& pp, const ProcessGroup& cp = {}) {
  const std::vector<at::Tensor> params = pipe ? pipe->parameters() : model->unique_parameters();
  dtp::optim::AdamW opt(params, torch::optim::AdamWOptions(o.lr));
  // --mixed-precision f16: loss scaling, skipped steps agreed over the
  // world (an invalid group: one device alone).
  GradScaler scaler(GradScalerOptions().enabled(o.mixed_precision == "f16").group(world));
  // GPipe: the load-balancing loss over every stage and microbatch, added to the step's loss.
  if (pipe && model->config.moe.num_experts > 0 && model->config.moe.aux_loss_coef > 0)
    pipe->add_load_balancing_loss(dp.valid() ? std::optional<ProcessGroup>(dp) : std::nullopt);
  const int64_t first = startFrom(o, model, pipe, opt, scaler);
  if (scaler.is_enabled() && first > 0 && log && world.rank() == 0)
    std::printf("loss scaling: resumed at scale %g after %lld clean steps\n", scaler.get_scale(),
                static_cast<long long>(scaler.growth_tracker()));
  // --save-every: saves in the background while training goes on.
  std::unique_ptr<dcp::AsyncSaver> saver;
  if (!o.save.empty() && o.save_every > 0) saver = std::make_unique<dcp::AsyncSaver>();
  auto stateAt = [&](int64_t step) {
    dcp::StateDict sd = pipe ? pipe->state_dict(model, &opt) : dcp::get_state_dict(*model, &opt, llama_state_dict_options());
    sd.metadata["step"] = std::to_string(step);
    if (scaler.is_enabled()) sd.metadata["grad_scaler"] = scalerMetadata(scaler);
    sd.metadata[kLlamaConfigKey] = llama_config_to_json(configOf(o));
    return sd;
  };
  // --keep-last: rank 0 removes dtp's own older step folders once a save is
  // committed (a save in flight is still "step-N.incomplete": not counted).
  auto keepLast = [&] {
    if (o.keep_last == 0 || world.rank() != 0) return;
    for (const auto& gone : dcp::remove_old_steps(o.save, o.keep_last)) {
      if (log) std::printf("removed the older checkpoint %s (--keep-last %lld)\n", gone.c_str(), static_cast<long long>(o.keep_last));
    }
  };
  Run run;
  CommCounter comm;
  auto t0 = std::chrono::steady_clock::now();
  int64_t tokens = 0;
  // --metrics: figures per logged step, over the steps since the previous one.
  std::optional<TraceRecorder> trace;
  if (log && !o.profile.empty()) std::filesystem::create_directories(o.profile);
  apps::MetricsWriter metrics(log && world.rank() == 0 ? o.metrics : "");
  auto last_log = t0;
  int64_t last_step = first, last_count = 0, last_bytes = 0;
  // Collectives of logging and metrics (the rss maximum, the gradient norm
  // without clipping) are left out of the per-step figures.
  int64_t log_count = 0, log_bytes = 0;
  auto notCounted = [&](const std::function<void()>& fn) {
    const int64_t count = comm.total_count(), bytes = comm.total_bytes();
    fn();
    log_count += comm.total_count() - count;
    log_bytes += comm.total_bytes() - bytes;
  };
  for (int64_t step = first; step < o.steps; ++step) {
    at::Tensor b = apps::corpus_batch(corpus, o.batch, o.seq, o.seed, step).to(model->config.device);
    if (dp.valid()) b = b.narrow(0, dp.rank() * o.batch / dp.size(), o.batch / dp.size());
    // --comm-debug: the first step's collectives per module, pass and op.
    std::optional<CommDebugMode> debug;
    if (!o.comm_debug.empty() && step == first) debug.emplace();
    // --profile: a trace of o.profile_steps steps after the first (warm-up).
    const int64_t traced = std::min(first + 1, o.steps - 1);
    if (log && !o.profile.empty() && step == traced) trace.emplace(TraceOptions{o.device == "cuda"});
    at::Tensor loss, aux;
    if (pipe) {  // forward and backward of every microbatch; the loss on the last stage
      opt.zero_grad();
      // Under --cp: this rank's positions, before the microbatches are cut
      // (NOTE: [Context parallelism in a pipeline]).
      const auto in = context_parallel_shard_batch(model, {b.narrow(1, 0, o.seq), b.narrow(1, 1, o.seq)});
      loss = pipe->pipeline->step(in[0], in[1]);
    } else {
      const auto in = context_parallel_shard_batch(model, {b.narrow(1, 0, o.seq), b.narrow(1, 1, o.seq)});
      loss = llama_loss(model, model(in[0]), in[1]);
      if (model->config.moe.aux_loss_coef > 0) {
        aux = moe_load_balancing_loss(model, dp.valid() ? std::optional<ProcessGroup>(dp) : std::nullopt);
        loss = loss + aux;
      }
      opt.zero_grad();
      scaler.scale(loss).backward();
    }
    scaler.unscale_(opt);  // before clipping (nothing when disabled)
    if (debug) {
      apps::write_comm_debug(*debug, o.comm_debug, world);
      debug.reset();
    }
    const bool logged = log && ((step + 1) % o.log_every == 0 || step + 1 == o.steps);
    at::Tensor grad_norm;
    if (o.clip > 0) {
      grad_norm = clip_grad_norm_(params, o.clip, 2.0, pp);  // pp: invalid without a pipeline
    } else if (logged && !o.metrics.empty()) {
      notCounted([&] { grad_norm = clip_grad_norm_(params, INFINITY, 2.0, pp); });  // scales by 1: exact
    }
    for (auto& g : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(learningRate(o, step));
    if (!scaler.step(opt)) ++run.skipped;  // an inf or NaN gradient on some rank (float16)
    scaler.update();
    at::Tensor reported = !loss.defined() ? at::zeros({1}, at::kDouble)
                          : (is_dtensor(loss) ? full_tensor(loss) : loss).detach().to(at::kDouble).reshape({1});
    if (pipe) notCounted([&] { pp.all_reduce(reported); });  // from the last stage to every rank
    if (dp.valid()) dp.all_reduce(reported, ReduceOp::Avg);
    if (cp.valid()) cp.all_reduce(reported, ReduceOp::Avg);
    run.losses.push_back(reported.item<double>());
    if (trace && (step + 1 == traced + o.profile_steps || step + 1 == o.steps)) {
      const std::string path = o.profile + "/rank" + std::to_string(world.rank()) + ".json";
      trace->export_chrome_trace(path);
      trace.reset();
      if (world.rank() == 0)
        std::printf("profile: steps %lld to %lld traced (%s profiler) in %s/rank*.json: open in ui.perfetto.dev or "
                    "chrome://tracing\n", static_cast<long long>(traced + 1), static_cast<long long>(step + 1),
                    TraceRecorder::backend(), o.profile.c_str());
    }
    tokens += o.batch * o.seq;
    if (saver && (step + 1) % o.save_every == 0 && step + 1 < o.steps) {
      saver->save(stateAt(step + 1), dcp::step_folder(o.save, step + 1));
      if (log && world.rank() == 0) std::printf("step %5lld  saving to %s in the background\n", static_cast<long long>(step + 1), dcp::step_folder(o.save, step + 1).c_str());
      keepLast();  // the previous save is committed: save() waited for it
    }
    if (logged) {
      const auto now = std::chrono::steady_clock::now();
      const double s = std::chrono::duration<double>(now - t0).count();
      const int64_t count = comm.total_count() - log_count, bytes = comm.total_bytes() - log_bytes;
      at::Tensor rss = at::full({1}, peakRssMiB(), at::kDouble);
      if (world.size() > 1) notCounted([&] { world.all_reduce(rss, ReduceOp::Max); });
      if (world.rank() == 0) {
        std::printf("step %5lld  loss %.4f  %8.0f tok/s  peak rss %.0f MiB/rank (max)  comm %.2f MiB/rank\n",
                    static_cast<long long>(step + 1), run.losses.back(), tokens / s, rss.item<double>(),
                    bytes / 1048576.0);
        std::fflush(stdout);
      }
      const double steps = static_cast<double>(step + 1 - last_step),
                   interval = std::chrono::duration<double>(now - last_log).count();
      apps::StepMetrics m;
      m.step = step + 1;
      m.loss = run.losses.back();
      m.tokens_per_s = steps * o.batch * o.seq / interval;
      m.step_ms = 1e3 * interval / steps;
      m.peak_rss_mib = rss.item<double>();
      m.collectives_per_step = (count - last_count) / steps;
      m.comm_bytes_per_step = (bytes - last_bytes) / steps;
      m.grad_norm = grad_norm.defined() ? grad_norm.item<double>() : std::nan("");
      m.lr = learningRate(o, step);
      if (!pipe && model->config.moe.num_experts > 0 && !o.metrics.empty()) {  // every rank: a collective
        notCounted([&] { moeMetrics(model, aux, dp, cp, m); });
      }
      metrics.write(m);
      last_log = now;
      last_step = step + 1;
      last_count = count;
      last_bytes = bytes;
    }
  }
  if (saver) saver->wait();
  if (!o.save.empty()) {
    dcp::save(stateAt(o.steps), dcp::step_folder(o.save, o.steps));
    keepLast();
  }
  if (!o.save_hf.empty()) {
    HFSaveOptions hf;
    hf.source_dir = o.init_from_hf;
    save_hf(model, o.save_hf, hf);
  }
  if (o.check_parity) run.params = fullParams(model, pipe, pp);
  if (log && world.rank() == 0) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("done: %lld steps in %.1f s, loss %.4f -> %.4f, %.0f tok/s, %lld collectives (%s)\n",
                static_cast<long long>(o.steps - first), s, run.losses.empty() ? 0.0 : run.losses.front(),
                run.losses.empty() ? 0.0 : run.losses.back(), tokens / s,
                static_cast<long long>(comm.total_count()), comm.str().c_str());
    if (scaler.is_enabled())
      std::printf("loss scaling: %lld of %lld steps skipped (an inf or NaN gradient), scale now %g\n",
                  static_cast<long long>(run.skipped), static_cast<long long>(o.steps - first), scaler.get_scale());
  }
  return run;
}

// Largest differences between two runs of the same steps: losses, and
// parameters (compared in float64).
struct Diff {
  double loss = 0, param = 0, param_mean = 0;  // max over steps, max and mean over weights
};

Diff diff(const Run& a, const Run& b) {
  Diff d;
  for (size_t i = 0; i < a.losses.size(); ++i) d.loss = std::max(d.loss, std::abs(a.losses[i] - b.losses[i]));
  double sum = 0;
  int64_t n = 0;
  for (size_t i = 0; i < a.params.size(); ++i) {
    const at::Tensor e = (a.params[i].second.to(at::kDouble) - b.params[i].second.to(at::kDouble)).abs();
    d.param = std::max(d.param, e.max().item<double>());
    sum += e.sum().item<double>();
    n += e.numel();
  }
  d.param_mean = n > 0 ? sum / static_cast<double>(n) : 0;
  return d;
}

// The same steps on one device (this rank, plain tensors) in `dtype`; with
// `mp`, under the run's mixed-precision policy (apply_mixed_precision).
Run trainOneDevice(Options o, const at::Tensor& corpus, const std::string& dtype, bool mp) {
  o.model.dtype = dtype;
  o.save.clear();
  o.save_hf.clear();
  o.resume.clear();
  o.saved_config.reset();
  auto one = ProcessGroup::create(c10::make_intrusive<c10d::HashStore>(), 0, 1);
  DeviceMesh alone = init_device_mesh(o.device, {1}, {"dp"}, one);
  LlamaConfig c = configOf(o);
  c.device = alone.device();
  Llama ref(c);
  if (mp) apply_mixed_precision(*ref, *mpPolicy(o));
  at::manual_seed(o.seed);
  return train(ref, nullptr, o, corpus, /*log=*/false, ProcessGroup(), ProcessGroup(), ProcessGroup());
}

// float64: TP must equal one device up to float64 rounding, which AdamW
// amplifies at most by lr/eps per step (a gradient change d moves a weight
// by <= lr * d / eps): bound steps * lr * 1e-14 / eps for the weights, with
// 1e-14 a generous bound on float64 gradient rounding here (values <= O(1)).
// float32: TP cannot equal one device (another summation order rounds
// otherwise); it must be as exact as one device: no further from the float64
// run than 4x one device's own float32 distance from it, plus 16 ulps of the
// values' scale (see NOTE: [Float32 parity tolerance] in tests/llama_test.cpp).
// The losses are held to that. The weights are not, in the max: AdamW turns
// a rounding-sized change of a near-zero gradient into a move of up to its
// step bound, so the largest weight difference depends on which few entries
// round across zero, not on how exact the run is (a 16-core H100 host: TP
// 1.4e-4 from float64, one device 3.1e-5). The mean weight difference over
// all entries averages that out and is held to the bound; the max only to
// AdamW's: each step moves a weight by at most lr * (1 - beta1) /
// sqrt(1 - beta2) (Kingma & Ba, 2.1), so two runs differ by at most twice that
// per step.
// --mixed-precision bf16: the same, against one device under the same policy, with bf16's
// ulp (NOTE: [Mixed-precision parity tolerance] in tests/data_parallel_test.cpp).
int checkParity(const Options& o, const at::Tensor& corpus, const Run& tp) {
  const bool mp = !o.mixed_precision.empty();
  const Run one = trainOneDevice(o, corpus, o.model.dtype, mp);
  const Diff d = diff(tp, one);
  const size_t steps = one.losses.size();
  bool ok = false;
  if (o.model.dtype == "float64") {
    const double param_tol = steps * o.lr * 1e-14 / 1e-8, loss_tol = 1e-10;
    ok = d.loss <= loss_tol && d.param <= param_tol;
    std::printf("parity vs one device in float64 over %zu steps: max |loss diff| %.3g, max |param diff| %.3g "
                "(tolerance %.3g, %.3g): %s\n", steps, d.loss, d.param, loss_tol, param_tol, ok ? "ok" : "FAILED");
  } else {
    const Run exact = trainOneDevice(o, corpus, "float64", false);
    const Diff tp_err = diff(tp, exact), one_err = diff(one, exact);
    double loss_scale = 0, param_sum = 0;
    int64_t param_count = 0;
    for (double l : exact.losses) loss_scale = std::max(loss_scale, std::abs(l));
    for (auto& [name, p] : exact.params) {
      param_sum += p.abs().sum().item<double>();
      param_count += p.numel();
    }
    const double u = !mp ? 5.96e-8 : o.mixed_precision == "f16" ? 4.88e-4 : 3.9e-3;  // float32, float16 or bf16 unit roundoff
    const double loss_tol = 4 * one_err.loss + 16 * u * loss_scale;
    const double mean_tol = 4 * one_err.param_mean + 16 * u * param_sum / static_cast<double>(std::max<int64_t>(param_count, 1));
    const double max_tol = 2 * static_cast<double>(steps) * o.lr * 0.1 / std::sqrt(1 - 0.999);  // AdamW's defaults
    ok = tp_err.loss <= loss_tol && tp_err.param_mean <= mean_tol && tp_err.param <= max_tol;
    std::printf("parity vs one device in %s over %zu steps: max |loss diff| %.3g, max |param diff| %.3g; "
                "distance from float64 of this run: loss %.3g, weights mean %.3g (max %.3g), of one device: %.3g, %.3g (%.3g) "
                "(tolerance %.3g, %.3g (%.3g)): %s\n",
                mp ? (o.mixed_precision + " mixed precision").c_str() : "float32", steps, d.loss, d.param, tp_err.loss, tp_err.param_mean, tp_err.param,
                one_err.loss, one_err.param_mean, one_err.param, loss_tol, mean_tol, max_tol, ok ? "ok" : "FAILED");
  }
  return ok ? 0 : 1;
}

// A pipeline rank's stage mesh: every dimension but "pp".
DeviceMesh withoutPp(const DeviceMesh& mesh) {
  std::vector<std::string> names;
  for (const auto& name : mesh.mesh_dim_names())
    if (name != "pp") names.push_back(name);
  return mesh[names];
}

// Whether `dir` holds a step-<N>/ folder (not a step-<N>.incomplete/).
bool hasCompleteStep(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) == 0 && name.size() > 5 &&
        name.find_first_not_of("0123456789", 5) == std::string::npos && e.is_directory(ec))
      return true;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"dtp-train: tensor-parallel Llama training on byte-level text (run under dtprun -n N)"};
  add_options(app, o);
  CLI11_PARSE(app, argc, argv);
  try {
    ProcessGroup world = init_process_group();
    const int64_t W = world.size();
    TORCH_CHECK(o.keep_last == 0 || !o.save.empty(), "--keep-last needs --save DIR: which folder's steps to keep.");
    TORCH_CHECK(o.save.empty() || !std::filesystem::exists(o.save + "/" + io::CheckpointIndex::kFileName),
                "--save '", o.save, "' is a checkpoint of the older flat layout; --save writes step-<N>/ folders "
                "inside the folder it names. Pass a new folder (--resume '", o.save, "' still loads this one).");
    // Restarted by dtprun/torchrun --max-restarts with --save DIR --resume DIR,
    // the first attempt finds no step-<N>/ yet and starts from step 0.
    if (!o.resume.empty() && o.resume == o.save && !hasCompleteStep(o.resume)) {
      if (world.rank() == 0) std::printf("dtp-train: no complete step-<N>/ in %s yet; starting from step 0\n", o.save.c_str());
      o.resume.clear();
    }
    if (!o.resume.empty() && !std::filesystem::is_regular_file(o.resume)) {
      const apps::SavedCheckpoint saved = apps::find_saved_checkpoint(o.resume, world.rank() == 0);
      if (world.rank() == 0) std::printf("dtp-train: resuming from %s\n", saved.path.c_str());
      o.resume = saved.path;
      if (saved.config && o.init_from_hf.empty()) {
        apps::adopt_saved_config(app, o.model, *saved.config, saved.path);
        o.saved_config = saved.config;
      }
    }
    const int64_t pp = o.pp, ep = o.ep, cp = o.cp;
    // With --ep and --cp, ep borrows cp's ranks too (torchtitan's ep =
    // dp_shard_in_ep x cp; NOTE: [Context parallelism with expert
    // parallelism]): the ranks of one (pp, dp, tp) coordinate are ep, cp among them.
    TORCH_CHECK(ep == 1 || cp == 1 || ep % cp == 0, "--ep ", ep, " with --cp ", cp, ": expert parallelism borrows "
                "the cp ranks (ep = dp_shard_in_ep x cp, as torchtitan's): got an ep that is not a multiple of cp, "
                "expected one. Use --ep ", cp, " or a multiple of it.");
    const int64_t epcp = ep > 1 ? ep : cp;
    const int64_t tp = o.tp > 0 ? o.tp : o.dp > 0 ? W / (pp * o.dp * epcp) : W / (pp * epcp),
                  dp = o.dp > 0 ? o.dp : W / (pp * epcp * tp);
    TORCH_CHECK(pp * dp * epcp * tp == W, pp > 1 ? c10::str("--pp ", pp, " x ") : "", "--dp ", dp,
                ep > 1 ? c10::str(" x --ep ", ep, cp > 1 ? c10::str(" (--cp ", cp, " among them)") : "")
                       : cp > 1 ? c10::str(" x --cp ", cp) : "",
                " x --tp ", tp, " = ", pp * dp * epcp * tp, " ranks, but WORLD_SIZE=", W, ". Choose degrees whose "
                "product is the number of ranks (dtprun -n ", pp * dp * epcp * tp, ").");
    // The ranks that train on their own rows of each batch (cp ranks share theirs).
    const int64_t rows = ep > 1 ? dp * ep / cp : dp;
    // The model: the flags', the HF folder's or the checkpoint's.
    LlamaConfig config = configOf(o);
    const MoEConfig& moe = config.moe;
    TORCH_CHECK(ep == 1 || moe.num_experts > 0, "--ep ", ep, " spreads the experts of MoE layers; the model has none. "
                "Add --experts N (a multiple of ", ep, "), or drop --ep.");
    TORCH_CHECK(!o.shard_experts || (moe.num_experts > 0 && ep == 1), "--shard-experts cuts the experts of MoE "
                "layers over --tp: it needs --experts N and no --ep (one or the other).");
    TORCH_CHECK(ep == 1 || o.batch % rows == 0, "--batch ", o.batch, " is not divisible by --dp ", dp, " x --ep ",
                ep, cp > 1 ? c10::str(" / --cp ", cp) : "", ": each of those ranks trains batch/", rows, " sequences",
                cp > 1 ? " (the cp ranks among them share theirs)" : "", ". Use a multiple of ", rows, ".");
    TORCH_CHECK(pp == 1 || moe.num_experts == 0 || moe.aux_loss_coef == 0 || o.pipeline_schedule == "gpipe",
                "--pp with --experts and --aux-loss-coef ", moe.aux_loss_coef, " under --schedule ",
                o.pipeline_schedule, ": the MoE load-balancing loss sums every microbatch's routing before the first "
                "backward, which only GPipe runs. Use --schedule gpipe, or --aux-loss-coef 0.");
    TORCH_CHECK(pp == 1 || (o.save_hf.empty() && o.init_from_hf.empty()), "--pp: Hugging Face folders "
                "(--save-hf, --init-from-hf) with a pipeline are NYI. Fine-tune or export without --pp; --save and "
                "--resume folders move between pp layouts.");
    const int64_t microbatches = o.microbatches > 0 ? o.microbatches : pp;  // pipeline_llama's default too
    TORCH_CHECK(pp == 1 || (o.batch / rows) % microbatches == 0, "--batch ", o.batch, " over --dp ", dp,
                ep > 1 ? c10::str(" x --ep ", ep, cp > 1 ? c10::str(" / --cp ", cp) : "") : "", " gives ",
                o.batch / rows, " sequences per rank, not divisible by ", microbatches,
                " microbatches. Choose --batch and --microbatches so that batch / ", rows, " is a multiple of the "
                "microbatches.");
    TORCH_CHECK(o.batch % dp == 0, "--batch ", o.batch, " is not divisible by --dp ", dp,
                ": each data-parallel rank trains batch/dp sequences. Use a multiple of ", dp, ".");
    const MemoryEstimate need = estimateMemory(o, rows, tp);
    const double have = availableBytesPerRank(world.size());
    // On a GPU the step lives in GPU memory, which CUDA's allocator guards (an out-of-memory error).
    TORCH_CHECK(o.device != "cpu" || need.total() <= have, "this configuration needs at least ", gib(need.total()),
                " per rank (parameters, gradients and AdamW state ", gib(need.states), ", activations ",
                gib(need.activations), " of which attention scores ", gib(need.scores), " for --batch ", o.batch,
                " --seq ", o.seq, "), but ", gib(have), " are available per local rank. Lower --seq or --batch, "
                "shrink the model, or use more ranks.");
    TORCH_CHECK(o.save_every == 0 || !o.save.empty(), "--save-every needs --save DIR: where to save.");
    // Byte-level tokens, or the HF folder's tokenizer (tokenizer.json, else
    // tokenizer.model): a folder with a tokenizer never trains on bytes.
    const bool hfTokenizer = !o.init_from_hf.empty() && (std::filesystem::exists(o.init_from_hf + "/tokenizer.model") ||
                                                         std::filesystem::exists(o.init_from_hf + "/tokenizer.json"));
    const auto tokenizer = load_tokenizer(hfTokenizer ? o.init_from_hf : "byte");
    check_tokenizer_fits_model(*tokenizer, config.vocab_size, o.init_from_hf.empty() ? "dtp-train's model" : o.init_from_hf);
    const at::Tensor corpus = apps::load_corpus(o.data, tokenizer.get());
    TORCH_CHECK(o.mixed_precision.empty() || o.model.dtype == "float32", "--mixed-precision ", o.mixed_precision,
                " keeps float32 master weights: drop --dtype ", o.model.dtype, ".");
    TORCH_CHECK(o.mixed_precision != "f16" || pp == 1, "NYI: --mixed-precision f16 with --pp: the pipeline runs "
                "each microbatch's backward itself, without GradScaler's loss scale. Use --mixed-precision bf16 "
                "(float32's range: no scaling needed), or f16 without --pp.");
    TORCH_CHECK(o.mixed_precision != "f16" || o.device != "cpu" || DTP_HAS_CPU_HALF_MATMUL, "--mixed-precision f16 "
                "on CPU: this libtorch (", TORCH_VERSION, ") has no float16 matrix product on CPU (libtorch 2.1 and "
                "later do). Use --mixed-precision bf16, or libtorch 2.x.");
    const bool fsdp = (dp * ep > 1 || cp > 1) && !o.ddp;
    // --cp: torchtitan's mesh, (pp, dp_shard, cp, tp) without the degrees of
    // 1, with dp_shard_cp (FSDP's or DDP's) and dp_cp flattened; with --ep,
    // (dp_shard_mod_ep, dp_shard_in_ep, cp, tp), ep = (dp_shard_in_ep, cp).
    DeviceMesh mesh = cp > 1 ? ParallelDims().pp(pp).dp_shard(rows).cp(cp).ep(ep).tp(tp).world_size(W).build_mesh(o.device)
                      : pp > 1 && ep > 1   ? init_device_mesh(o.device, {pp, dp, ep, tp}, {"pp", "dp", "ep", "tp"})
                      : pp > 1             ? init_device_mesh(o.device, {pp, dp, tp}, {"pp", "dp", "tp"})
                      : ep > 1             ? init_device_mesh(o.device, {dp, ep, tp}, {"dp", "ep", "tp"})
                      : dp > 1 || fsdp     ? init_device_mesh(o.device, {dp, tp}, {"dp", "tp"})
                                           : init_device_mesh(o.device, {tp}, {"tp"});
    // Each rank allocates its shards (of its stages) only. DDP over cp alone
    // (ParallelDims' mesh has no tp of 1 to shard over) holds the whole model
    // anyway, and replicate takes initialized parameters: eager there.
    config.deferred_init = !o.eager_init && !(cp > 1 && !fsdp && tp == 1);
    config.device = mesh.device();
    Llama model(config);
    if (world.rank() == 0)
      std::printf("dtp-train: %s%s%s, %lld layers, dim %lld, %lld heads (%lld kv), %.2f M %s parameters, %s%s%s; corpus %.1f M tokens (%s)%s%s\n",
                  mesh.str().c_str(), cp > 1 ? c10::str(" ", o.cp_attention, " attention, ", o.cp_layout, " layout,").c_str() : "",
                  (std::string(fsdp ? " FSDP" : dp * ep > 1 || cp > 1 ? " DDP" : "") + (o.mixed_precision.empty() ? "" : ", " + o.mixed_precision + " mixed precision")).c_str(), static_cast<long long>(config.n_layers), static_cast<long long>(config.dim),
                  static_cast<long long>(config.n_heads), static_cast<long long>(config.n_kv_heads),
                  [&] { int64_t n = 0; for (auto& p : model->unique_parameters()) n += p.numel(); return n / 1e6; }(),
                  o.model.dtype.c_str(),
                  tp > 1 && !o.no_sp && o.pp == 1 ? "sequence parallel" : "no sequence parallelism",
                  config.tie_embeddings ? ", tied embeddings" : "", o.dropout > 0 ? ", dropout" : "", corpus.numel() / 1e6,
                  tokenizer->name().c_str(), o.init_from_hf.empty() ? "" : ", from ", o.init_from_hf.c_str());
    ParallelizeOptions parallel;
    parallel.tp = TensorParallelOptions{!o.no_sp, o.seq};
    parallel.tp.shard_experts = o.shard_experts;
    if (o.ac != "none") parallel.ac = ACOptions{o.ac == "full" ? ACMode::Full : ACMode::Selective, o.ac_every};
    parallel.data_parallel = fsdp ? DataParallel::FSDP : DataParallel::DDP;
    parallel.cp = apps::cp_options_of(o.cp_attention, o.cp_layout);
    parallel.mp_policy = mpPolicy(o);
    std::optional<LlamaPipeline> pipe;
    if (pp > 1) {
      pipe = pipeline_llama(model, mesh, {o.pipeline_schedule, o.microbatches}, parallel);
      if (world.rank() == 0)
        std::printf("dtp-train: pipeline of %lld stages, %s schedule, %d microbatches per step (TP inside stages "
                    "without sequence parallelism)\n%s", static_cast<long long>(pp), o.pipeline_schedule.c_str(),
                    pipe->pipeline->schedule().microbatches(), pipe->pipeline->schedule().str().c_str());
    } else if (tp > 1 || dp * ep > 1 || cp > 1) {
      parallelize_llama(model, mesh, parallel);
    } else {  // one device
      if (parallel.ac) apply_ac(model, *parallel.ac);
      if (parallel.mp_policy) apply_mixed_precision(*model, *parallel.mp_policy);
    }
    if (world.rank() == 0 && (o.ac != "none" || o.clip > 0 || o.warmup > 0 || o.lr_schedule != "constant"))
      std::printf("dtp-train: activation checkpointing %s%s, gradient clipping %s, lr %g with %lld warmup steps, %s\n",
                  o.ac.c_str(), o.ac != "none" && o.ac_every > 1 ? c10::str(" (every ", o.ac_every, " blocks)").c_str() : "",
                  o.clip > 0 ? c10::str("at norm ", o.clip).c_str() : "off", o.lr, static_cast<long long>(o.warmup),
                  o.lr_schedule.c_str());
    if (config.deferred_init && pipe) pipe->init_weights(model);
    else if (config.deferred_init) init_weights(model);
    {
      at::Tensor rss = at::full({1}, peakRssMiB(), at::kDouble);
      if (world.size() > 1) world.all_reduce(rss, ReduceOp::Max);
      if (world.rank() == 0)
        std::printf("dtp-train: start-up peak rss %.0f MiB/rank (max), %s init\n", rss.item<double>(),
                    config.deferred_init ? "deferred" : "eager");
    }
    dtp::manual_seed(o.seed);
    at::manual_seed(o.seed);
    Run run = train(model, pipe ? &*pipe : nullptr, o, corpus, /*log=*/true, world,
                    ep > 1 || (cp > 1 && dp > 1) ? data_parallel_group(pp == 1 ? mesh : withoutPp(mesh))
                    : dp > 1 ? mesh.get_group("dp")
                             : ProcessGroup(),
                    pp > 1 ? mesh.get_group("pp") : ProcessGroup(), cp > 1 ? mesh.get_group("cp") : ProcessGroup());
    if (o.check_parity && world.rank() == 0) return checkParity(o, corpus, run);
  } catch (const c10::Error& e) {
    std::cerr << "dtp-train: " << e.what_without_backtrace() << "\n";  // a user error: no C++ backtrace
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "dtp-train: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
