// Greedy decode of a Hugging Face folder at TP = the ranks, fed token ids,
// printing the tokens (bench/decode_bench.py compares them with llama.cpp's)
// and, with --profile, where one decode step's time goes: per ATen op and
// input shapes, its self time per step against the bytes it reads
// (#59 item 1). libtorch 1.13 has no Kineto, so the timer is our own, on
// RecordFunction callbacks, which both libtorch lines have.
//
//   dtprun -n 2 build/bench/dtp_decode_profile --hf /tmp/hf1024 --prompt-ids 84,104,101 --tokens 16 \
//       --profile --bandwidth-gbs 20
//
// How a step is isolated (NOTE: [Decode step by difference]): generate()
// runs the prompt's prefill and then one forward per new token, so a run
// of 1 new token is prefill alone and a run of T tokens is prefill plus
// T - 1 decode steps; both are profiled and their difference divided by
// T - 1 is one decode step, the prefill cancelling out.
//
// Self time: an op's time less the ops it called (aten::linear -> matmul ->
// mm: the GEMM's time lands on mm). Bytes: the tensor inputs' bytes of the
// ops that call no other op (a view reads nothing; an embedding reads its
// output's rows, not the table). An op on a DTensor is shown as [D] name:
// its self time is DTensor's own cost (dispatch, sharding propagation,
// wrapping), its local op is a row of its own. Time outside any op (the
// generate loop, the engine's bookkeeping, collectives that record no op)
// is the step less the ops' sum, shown as (outside ops).
#include "dtensor/local_linear.h"
#include "dtp/device_mesh.h"
#include "dtp/dtensor.h"
#include "dtp/models/generate.h"
#include "dtp/models/hf_llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/nn/modules.h"
#include "dtp/process_group.h"

#include <ATen/ops/mm_cpu_dispatch.h>
#include <ATen/record_function.h>
#include <torch/library.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <ctime>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// --cpu-time: the profiling thread's CPU time instead of wall time, so that
// other processes on the machine (builds) do not land in the ops' times;
// exact with one intra-op thread (OMP_NUM_THREADS=1), where the op runs on
// this thread alone.
bool g_cpu_time = false;

double now_ns() {
  if (g_cpu_time) {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return 1e9 * static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec);
  }
  return std::chrono::duration<double, std::nano>(Clock::now().time_since_epoch()).count();
}

struct Cost {
  double self_ns = 0;
  double bytes = 0;
  int64_t calls = 0;
};

struct Frame {
  double start = 0;
  double child_ns = 0;
  bool child_read = false;  // a callee counted the bytes (matmul -> mm: mm's)
  std::string name;
  std::string key;
  double bytes = 0;
};

// The ops that read no data of their own (views, allocation, metadata).
bool reads_nothing(const std::string& name) {
  static const char* kViews[] = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided",
                                 "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze",
                                 "aten::transpose", "aten::t", "aten::permute", "aten::expand", "aten::narrow",
                                 "aten::detach", "aten::alias", "aten::_unsafe_view", "aten::empty",
                                 "aten::empty_strided", "aten::lift_fresh", "aten::resize_", "aten::unbind",
                                 "aten::split", "aten::chunk", "aten::empty_like", "aten::split_with_sizes",
                                 "aten::contiguous", "aten::to", "aten::_to_copy", "aten::item",
                                 "aten::_local_scalar_dense", "aten::is_nonzero", "aten::movedim",
                                 "aten::flatten", "aten::view_as", "aten::expand_as", "aten::size", "aten::stride",
                                 "aten::resolve_conj", "aten::resolve_neg", "aten::conj", "aten::zeros",
                                 "aten::ones", "aten::full", "aten::arange", "aten::scalar_tensor"};
  for (const char* v : kViews) {
    if (name == v) return true;
  }
  return false;
}

struct Profiler {
  std::thread::id thread = std::this_thread::get_id();
  std::vector<Frame> stack;
  std::map<std::string, Cost> costs;
  bool on = false;
};

Profiler& profiler() {
  static Profiler p;
  return p;
}

std::string dtype_short(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return "f32";
    case c10::ScalarType::BFloat16: return "bf16";
    case c10::ScalarType::Half: return "f16";
    case c10::ScalarType::Long: return "i64";
    case c10::ScalarType::Int: return "i32";
    case c10::ScalarType::Char: return "i8";
    case c10::ScalarType::Bool: return "b8";
    default: return c10::toString(t);
  }
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  Profiler& p = profiler();
  if (!p.on || std::this_thread::get_id() != p.thread) return nullptr;
  Frame f;
  const std::string name = fn.name();
  std::ostringstream key;
  bool dtensor = false;
  double bytes = 0;
  key << "(";
  bool first = true;
  for (const c10::IValue& v : fn.inputs()) {
    if (!v.isTensor()) continue;
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) continue;
    dtensor = dtensor || dtp::is_dtensor(t);
    key << (first ? "" : ", ") << dtype_short(t.scalar_type()) << t.sizes();
    first = false;
    bytes += static_cast<double>(t.numel()) * static_cast<double>(t.element_size());
  }
  key << ")";
  if (name == "aten::embedding" || name == "aten::index_select") bytes = 0;  // set at the end from the output
  f.name = (dtensor ? "[D] " : "") + name;
  f.key = f.name + key.str();
  f.bytes = dtensor || reads_nothing(name) ? 0 : bytes;
  f.start = now_ns();
  p.stack.push_back(std::move(f));
  return nullptr;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  Profiler& p = profiler();
  if (!p.on || std::this_thread::get_id() != p.thread || p.stack.empty()) return;
  Frame f = std::move(p.stack.back());
  p.stack.pop_back();
  const double ns = now_ns() - f.start;
  Cost& c = p.costs[f.key];
  c.self_ns += ns - f.child_ns;
  c.calls += 1;
  // The bytes are the innermost reader's: an op whose callee counted them
  // (linear -> matmul -> mm) counts none.
  double bytes = f.child_read ? 0 : f.bytes;
  if (!f.child_read && (f.name == "aten::embedding" || f.name == "aten::index_select")) {
    for (const c10::IValue& v : fn.outputs()) {
      if (v.isTensor()) bytes += static_cast<double>(v.toTensor().numel()) * v.toTensor().element_size();
    }
  }
  c.bytes += bytes;
  if (!p.stack.empty()) {
    p.stack.back().child_ns += ns;
    p.stack.back().child_read = p.stack.back().child_read || f.child_read || bytes > 0;
  }
}

std::vector<int64_t> parse_ids(const std::string& s) {
  std::vector<int64_t> ids;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) ids.push_back(std::stoll(item));
  }
  return ids;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The weights one decode step multiplies, by name: [out, in].
std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> decode_weights(const dtp::models::LlamaConfig& c) {
  const int64_t hd = c.head_dim();
  return {{"q/o", {c.dim, c.dim}},         {"k/v", {c.n_kv_heads * hd, c.dim}}, {"gate/up", {c.ffn_hidden, c.dim}},
          {"down", {c.dim, c.ffn_hidden}}, {"head", {c.vocab_size, c.dim}}};
}

// The fastest of `reps` passes of call(0) ... call(n - 1), in ms.
double best_ms(int reps, int n, const std::function<void(int)>& call) {
  double ms = 1e30;
  for (int r = 0; r < reps; ++r) {
    for (int i = 0; i < n; ++i) {
      const auto t0 = Clock::now();
      call(i);
      ms = std::min(ms, std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
  }
  return ms;
}

// --gemv: the decode step's matrix-vector products alone: aten::linear on a
// [1, 1, in] row (which libtorch sends to a GEMM with one row), at::mv on
// the same weight (the BLAS's GEMV), and dtp's one-row path as the model
// runs it (NOTE: [One-row linear]: Eigen's GEMV where dtp was built with
// it), each the best of `reps` calls over fresh weights per shape (more
// than the caches hold, so each call reads its weight from memory), in GB/s
// of weight read.
void gemv_table(const dtp::models::LlamaConfig& c, c10::ScalarType dtype, int reps, double bandwidth_gbs) {
  std::printf("\nMatrix-vector products of one decode step, %s, %d intra-op thread(s), best of %d:\n",
              dtype_short(dtype).c_str(), at::get_num_threads(), reps);
  std::printf("| weight | [out, in] | MB | linear ms | linear GB/s | mv ms | mv GB/s | dtp one-row ms | dtp one-row GB/s |%s\n"
              "|---|---|---:|---:|---:|---:|---:|---:|---:|%s\n",
              bandwidth_gbs > 0 ? " floor ms |" : "", bandwidth_gbs > 0 ? "---:|" : "");
  for (const auto& [name, shape] : decode_weights(c)) {
    const auto [out, in] = shape;
    const double mb = static_cast<double>(out * in) * c10::elementSize(dtype) / 1e6;
    // Enough copies to pass 256 MB, so that the weight of one call is not in a cache from the call before.
    const int copies = std::max(2, static_cast<int>(256.0 / mb) + 1);
    std::vector<at::Tensor> w;
    for (int i = 0; i < copies; ++i) w.push_back(at::randn({out, in}).to(dtype));
    const at::Tensor x = at::randn({1, 1, in}).to(dtype);
    const at::Tensor xv = x.view({in});
    auto best = [&](const std::function<void(const at::Tensor&)>& f) {
      return best_ms(reps, copies, [&](int i) { f(w[i]); });
    };
    at::NoGradGuard no_grad;
    const double linear_ms = best([&](const at::Tensor& t) { (void)at::linear(x, t); });
    const double mv_ms = best([&](const at::Tensor& t) { (void)at::mv(t, xv); });
    const double row_ms = best([&](const at::Tensor& t) { (void)dtp::detail::local_linear(x, t, at::Tensor()); });
    const at::Tensor diff = (at::linear(x, w[0]).view({out}) - at::mv(w[0], xv)).abs().max();
    const at::Tensor row_diff =
        (dtp::detail::local_linear(x, w[0], at::Tensor()).view({out}) - at::mv(w[0], xv)).abs().max();
    std::printf("| %s | [%lld, %lld] | %.1f | %.3f | %.1f | %.3f | %.1f | %.3f | %.1f |", name.c_str(), (long long)out,
                (long long)in, mb, linear_ms, mb / linear_ms, mv_ms, mb / mv_ms, row_ms, mb / row_ms);
    if (bandwidth_gbs > 0) std::printf(" %.3f |", mb / bandwidth_gbs);
    std::printf(" max |linear - mv| %.1e, |one-row - mv| %.1e\n", diff.to(at::kFloat).item<float>(),
                row_diff.to(at::kFloat).item<float>());
  }
}

// --gemv, then: the same products with the weight stored narrow, float32
// activations (the weight-only kernel, NOTE: [Weight-only linears]): bf16,
// and int8 in groups of 32 with float16 scales (the default, NOTE: [Float16
// scales]; GB/s count the int8 bytes and the scales), and the same with
// float32 scales. "again" reruns one weight back to back, from the caches
// where it fits them (the kernel's own speed); the other columns read from
// memory.
void weight_only_table(const dtp::models::LlamaConfig& c, int reps) {
  if (c.dim % 32 != 0 || c.ffn_hidden % 32 != 0) {
    std::printf("\n(No weight-only table: int8 groups of 32 inputs need dim %lld and ffn %lld to be multiples "
                "of 32.)\n", (long long)c.dim, (long long)c.ffn_hidden);
    return;
  }
  std::printf("\nWeight-only matrix-vector products (x float32), %d intra-op thread(s), best of %d:\n",
              at::get_num_threads(), reps);
  std::printf("| weight | [out, in] | bf16 MB | bf16 ms | bf16 GB/s | again GB/s | int8 MB | int8 ms | int8 GB/s | "
              "again GB/s | f32 scales MB | ms | GB/s |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  at::NoGradGuard no_grad;
  for (const auto& [name, shape] : decode_weights(c)) {
    const auto [out, in] = shape;
    const double f32_mb = static_cast<double>(out * in) * 4 / 1e6;
    const int copies = std::max(2, static_cast<int>(256.0 / (f32_mb / 4)) + 1);
    std::vector<at::Tensor> bf16, q, scales, scales16;
    for (int i = 0; i < copies; ++i) {
      const at::Tensor w = at::randn({out, in});
      bf16.push_back(w.to(at::kBFloat16));
      const at::Tensor s = w.view({out, in / 32, 32}).abs().amax(-1) / 127;  // groups of 32 (Q8_0's)
      const at::Tensor qg = at::round(w.view({out, in / 32, 32}) / s.unsqueeze(-1)).clamp(-127, 127);
      q.push_back(qg.to(at::kChar).view({out, in}));
      scales.push_back(s.contiguous());
      scales16.push_back(s.to(at::kHalf));
    }
    const at::Tensor x = at::randn({1, in});
    auto bf16Call = [&](int i) { (void)dtp::nn::weight_only_linear(x, bf16[i], at::Tensor(), at::Tensor()); };
    auto int8Call = [&](int i) { (void)dtp::nn::weight_only_linear(x, q[i], scales16[i], at::Tensor()); };
    auto int8f32Call = [&](int i) { (void)dtp::nn::weight_only_linear(x, q[i], scales[i], at::Tensor()); };
    const double bf16_ms = best_ms(reps, copies, bf16Call);
    const double bf16_again = best_ms(reps, copies, [&](int) { bf16Call(0); });
    const double int8_ms = best_ms(reps, copies, int8Call);
    const double int8_again = best_ms(reps, copies, [&](int) { int8Call(0); });
    const double int8f32_ms = best_ms(reps, copies, int8f32Call);
    const double groups = static_cast<double>(out * in / 32);
    const double bf16_mb = f32_mb / 2, int8_mb = f32_mb / 4 + groups * 2 / 1e6, int8f32_mb = int8_mb + groups * 2 / 1e6;
    std::printf("| %s | [%lld, %lld] | %.1f | %.3f | %.1f | %.1f | %.1f | %.3f | %.1f | %.1f | %.1f | %.3f | %.1f |\n",
                name.c_str(), (long long)out, (long long)in, bf16_mb, bf16_ms, bf16_mb / bf16_ms, bf16_mb / bf16_again,
                int8_mb, int8_ms, int8_mb / int8_ms, int8_mb / int8_again, int8f32_mb, int8f32_ms,
                int8f32_mb / int8f32_ms);
  }
}

// --mv: what decode would gain from a matrix-vector path, measured without
// touching the library: aten::mm's CPU kernel is replaced, for this process
// only, by one that sends a float32 product of one row by a transposed
// contiguous weight (nn::Linear at batch 1: x [1, in] @ w.t()) to at::mv,
// and everything else to libtorch's own CPU mm (at::cpu::mm, which bypasses
// the dispatcher). libtorch warns once that a kernel was overridden.
at::Tensor mm_one_row_as_mv(const at::Tensor& self, const at::Tensor& mat2) {
  if (self.dim() == 2 && self.size(0) == 1 && self.scalar_type() == at::kFloat && mat2.scalar_type() == at::kFloat &&
      mat2.t().is_contiguous()) {
    return at::mv(mat2.t(), self.select(0, 0)).unsqueeze(0);
  }
  return at::cpu::mm(self, mat2);
}

void route_one_row_mm_to_mv() {
  static torch::Library lib(torch::Library::IMPL, "aten", c10::DispatchKey::CPU, __FILE__, __LINE__);
  lib.impl("mm", TORCH_FN(mm_one_row_as_mv));
}

struct Run {
  std::vector<std::vector<int64_t>> tokens;
  dtp::models::GenerateStats stats;
  double wall_ms = 0;
  std::map<std::string, Cost> costs;
};

Run run(dtp::models::Llama& model, const std::vector<int64_t>& prompt, int64_t new_tokens, bool profile) {
  dtp::models::GenerateOptions o;
  o.max_new_tokens = new_tokens;
  Profiler& p = profiler();
  p.costs.clear();
  p.stack.clear();
  p.on = profile;
  Run r;
  const double t0 = now_ns();
  r.tokens = dtp::models::generate(model, {prompt}, o, &r.stats);
  r.wall_ms = (now_ns() - t0) / 1e6;
  p.on = false;
  r.costs = p.costs;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string hf, prompt_ids = "84,104,101,32", dtype = "float32";
  int64_t tokens = 16, context = 0, top = 30;
  bool profile = false, gemv = false;
  double bandwidth_gbs = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      TORCH_CHECK(i + 1 < argc, "dtp_decode_profile: ", a, " needs a value.");
      return argv[++i];
    };
    if (a == "--hf") hf = next();
    else if (a == "--prompt-ids") prompt_ids = next();
    else if (a == "--tokens") tokens = std::stoll(next());
    else if (a == "--context") context = std::stoll(next());
    else if (a == "--dtype") dtype = next();
    else if (a == "--profile") profile = true;
    else if (a == "--cpu-time") g_cpu_time = true;
    else if (a == "--gemv") gemv = true;
    else if (a == "--mv") route_one_row_mm_to_mv();
    else if (a == "--top") top = std::stoll(next());
    else if (a == "--bandwidth-gbs") bandwidth_gbs = std::stod(next());
    else {
      std::cerr << "dtp_decode_profile: unknown argument '" << a << "'. Usage: --hf DIR [--prompt-ids a,b,c] "
                << "[--tokens N] [--context C] [--dtype float32|bfloat16] [--profile [--top K] "
                << "[--bandwidth-gbs G] [--cpu-time]] [--gemv] [--mv]\n";
      return 2;
    }
  }
  try {
    TORCH_CHECK(!hf.empty(), "dtp_decode_profile: pass --hf DIR, a Hugging Face Llama folder.");
    TORCH_CHECK(tokens >= 2, "dtp_decode_profile: --tokens ", tokens, ": a decode step needs at least 2 new tokens.");
    const std::vector<int64_t> prompt = parse_ids(prompt_ids);
    TORCH_CHECK(!prompt.empty(), "dtp_decode_profile: --prompt-ids is empty. Pass token ids, e.g. 84,104,101.");
    dtp::ProcessGroup world = dtp::init_process_group();
    const int rank = world.rank();
    const int64_t tp = world.size();
    dtp::models::LlamaConfig config = dtp::models::llama_config_from_hf(
        hf, context > 0 ? context : static_cast<int64_t>(prompt.size()) + tokens + 1);
    TORCH_CHECK(dtype == "float32" || dtype == "bfloat16", "dtp_decode_profile: --dtype ", dtype,
                ": expected float32 or bfloat16.");
    config.dtype = dtype == "bfloat16" ? c10::ScalarType::BFloat16 : c10::ScalarType::Float;
    if (gemv) {
      if (rank == 0) gemv_table(config, config.dtype, 3, bandwidth_gbs);
      if (rank == 0 && config.dtype == c10::ScalarType::Float) weight_only_table(config, 3);
      return 0;
    }
    dtp::DeviceMesh mesh = dtp::init_device_mesh("cpu", {tp}, {"tp"});
    dtp::models::Llama model = dtp::models::load_hf_model(config, hf, [&](dtp::models::Llama& m) {
      if (tp > 1) dtp::models::apply_tensor_parallel_for_inference(m, mesh);
    });
    model->eval();
    at::CallbackHandle handle = 0;
    if (profile) {
      profiler().thread = std::this_thread::get_id();
      handle = at::addGlobalCallback(at::RecordFunctionCallback(on_start, on_end).needsInputs(true).needsOutputs(true));
    }
    run(model, prompt, 2, false);  // warm-up: first-call allocations and caches
    const Run full = run(model, prompt, tokens, false);
    if (rank == 0) {
      std::printf("tokens:");
      for (size_t i = 0; i < full.tokens[0].size(); ++i) std::printf("%s%lld", i ? "," : "", (long long)full.tokens[0][i]);
      std::printf("\ndtp_decode_profile: TP=%lld, %s, prompt %zu: prefill %.1f ms, decode %.2f ms/token median\n",
                  (long long)tp, dtype.c_str(), prompt.size(), full.stats.prefill_ms, median(full.stats.decode_ms));
    }
    if (profile) {
      // See NOTE: [Decode step by difference] at the top.
      const Run pre = run(model, prompt, 1, true);
      const Run all = run(model, prompt, tokens, true);
      at::removeCallback(handle);
      const double steps = static_cast<double>(tokens - 1);
      const double step_ms = (all.wall_ms - pre.wall_ms) / steps;
      struct Row {
        std::string key;
        double ms, mb, calls;
      };
      std::vector<Row> rows;
      double op_ms = 0, total_mb = 0;
      for (const auto& [key, c] : all.costs) {
        Cost p;
        if (auto it = pre.costs.find(key); it != pre.costs.end()) p = it->second;
        Row r{key, (c.self_ns - p.self_ns) / 1e6 / steps, (c.bytes - p.bytes) / 1e6 / steps,
              static_cast<double>(c.calls - p.calls) / steps};
        if (r.calls <= 0 && r.ms <= 0) continue;
        op_ms += r.ms;
        total_mb += r.mb;
        rows.push_back(r);
      }
      // The same rows summed by op name alone: ops whose shapes change with
      // the cache's length (attention) are one row each per step otherwise.
      std::map<std::string, Row> by_name;
      for (const Row& r : rows) {
        const std::string name = r.key.substr(0, r.key.find('('));
        Row& n = by_name.emplace(name, Row{name, 0, 0, 0}).first->second;
        n.ms += r.ms;
        n.mb += r.mb;
        n.calls += r.calls;
      }
      std::vector<Row> names;
      for (const auto& [name, r] : by_name) names.push_back(r);
      auto table = [&](std::vector<Row> t, const char* title) {
        std::sort(t.begin(), t.end(), [](const Row& a, const Row& b) { return a.ms > b.ms; });
        std::printf("\n| %s | calls/step | ms/step | %% of step | MB read/step | GB/s |\n|---|---:|---:|---:|---:|---:|\n",
                    title);
        int64_t shown = 0;
        double rest_ms = 0, rest_mb = 0, rest_calls = 0;
        for (const Row& r : t) {
          if (shown++ < top) {
            char gbs[32] = "";
            if (r.mb > 0.01 && r.ms > 0) std::snprintf(gbs, sizeof gbs, "%.1f", r.mb / r.ms);
            std::printf("| %s | %.0f | %.3f | %.1f | %.2f | %s |\n", r.key.c_str(), r.calls, r.ms,
                        100 * r.ms / step_ms, r.mb, gbs);
          } else {
            rest_ms += r.ms;
            rest_mb += r.mb;
            rest_calls += r.calls;
          }
        }
        if (shown > top) std::printf("| (%lld other rows) | %.0f | %.3f | %.1f | %.2f | |\n", (long long)(shown - top),
                                     rest_calls, rest_ms, 100 * rest_ms / step_ms, rest_mb);
        std::printf("| (outside ops) | | %.3f | %.1f | | |\n", step_ms - op_ms, 100 * (step_ms - op_ms) / step_ms);
      };
      if (rank == 0) {
        std::printf("\nOne decode step, profiled (rank 0, TP=%lld, %s, %s): %.2f ms (the profiler's own cost "
                    "included; unprofiled %.2f ms wall), %.1f MB read by the ops",
                    (long long)tp, dtype.c_str(), g_cpu_time ? "this thread's CPU time" : "wall time", step_ms,
                    median(full.stats.decode_ms), total_mb);
        if (bandwidth_gbs > 0) std::printf(", floor %.2f ms at %.1f GB/s", total_mb / bandwidth_gbs, bandwidth_gbs);
        std::printf("\n");
        table(names, "op");
        table(rows, "op (inputs)");
      }
    }
  } catch (const c10::Error& e) {
    std::cerr << "dtp_decode_profile: " << e.what_without_backtrace() << "\n";
    return 1;
  }
  return 0;
}
