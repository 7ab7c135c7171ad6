// hf_check: the rank program of the Hugging Face interop test
// (run_hf_check.sh). One process per rank, under dtprun or torchrun:
//
//   dtprun -n 4 hf_check MODEL_DIR REFERENCE.safetensors OUT.safetensors EXPORT_DIR --dp 2 [--ddp]
//   dtprun -n 2 hf_check MODEL_DIR REFERENCE.safetensors OUT.safetensors EXPORT_DIR --greedy 6
//   dtprun -n 4 hf_check MODEL_DIR REFERENCE.safetensors OUT.safetensors - --pp 2
//
// - Reads input_ids from REFERENCE (written by llama_reference.py).
// - Builds the model of MODEL_DIR/config.json in float64, then in float32, at
//   (dp, tp) = (--dp, WORLD_SIZE / dp): TP without sequence parallelism,
//   then FSDP (DDP with --ddp) when dp > 1; loads MODEL_DIR's weights at that
//   layout; runs the tokens. Rank 0 writes logits_f64 and logits_f32 (full
//   tensors) to OUT, for compare_logits.py.
// - --greedy N (dp 1): the float64 model parallelized for inference
//   (apply_tensor_parallel_for_inference) continues every sequence by N
//   greedy tokens with the KV cache: greedy_f64 [batch, N] in OUT.
// - MoE folders: aux_f64, moe_load_balancing_loss after the float64 forward.
// - --ep: expert parallelism over all ranks instead (mesh ("ep")): rank r
//   feeds sequence r % batch; logits_f64/f32 gathered, each sequence's from
//   the first rank that fed it. --ep --tp T: an (ep, tp) mesh, the experts
//   over ep and TP (no SP) over tp, ep rank e feeding sequence e % batch;
//   --ep --dp D: a (dp, ep) mesh through parallelize_llama (FSDP, the experts
//   their own unit over dp), each of the dp x ep ranks its own sequence.
// - --pp P instead: a float64 pipeline over (pp, tp) = (P, WORLD_SIZE / P),
//   GPipe, one sequence per microbatch, computes the mean cross-entropy
//   against the tokens shifted by one (input_ids.roll(-1, 1)): loss_f64 in
//   OUT, written by the last stage's tp rank 0. No export.
// - Exports the float32 model (every layout but --pp) with save_hf to EXPORT_DIR in the dtype of
//   MODEL_DIR's files, split over several files, with MODEL_DIR as
//   source_dir, for compare_export.py. bf16, f16 and f32 weights are exact
//   in float32, so the export must reproduce them bit for bit.
// Rank 0 prints one line per step; an error exits 1 with its message.
#include "dtp/dtensor.h"
#include "dtp/io/safetensors.h"
#include "dtp/models/generate.h"
#include "dtp/models/hf_llama.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/process_group.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

using namespace dtp;
using namespace dtp::models;

namespace {

namespace fs = std::filesystem;

struct Args {
  std::string model_dir, reference, out, export_dir;
  int64_t dp = 1, pp = 1, greedy = 0, tp = 1;
  bool ddp = false, ep = false;
};

constexpr const char* kUsage =
    "usage: hf_check MODEL_DIR REFERENCE.safetensors OUT.safetensors EXPORT_DIR [--dp N [--ddp]] [--greedy N] "
    "[--pp N] [--ep [--tp N | --dp N]]";

Args parseArgs(int argc, char** argv) {
  Args a;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--dp" || arg == "--pp" || arg == "--greedy" || arg == "--tp") {
      TORCH_CHECK(i + 1 < argc, arg, " needs a value. ", kUsage);
      const std::string value = argv[++i];
      char* end = nullptr;
      const int64_t n = std::strtoll(value.c_str(), &end, 10);
      TORCH_CHECK(*end == '\0' && n > 0, arg, " must be a positive number, got '", value, "'.");
      (arg == "--dp" ? a.dp : arg == "--pp" ? a.pp : arg == "--tp" ? a.tp : a.greedy) = n;
    } else if (arg == "--ddp") {
      a.ddp = true;
    } else if (arg == "--ep") {
      a.ep = true;
    } else {
      positional.push_back(arg);
    }
  }
  TORCH_CHECK(positional.size() == 4, "got ", positional.size(), " arguments, expected 4. ", kUsage);
  a.model_dir = positional[0];
  a.reference = positional[1];
  a.out = positional[2];
  a.export_dir = positional[3];
  TORCH_CHECK(a.pp == 1 || (a.dp == 1 && a.greedy == 0), "--pp runs alone (no --dp, no --greedy). ", kUsage);
  TORCH_CHECK(a.greedy == 0 || a.dp == 1, "--greedy runs at dp 1. ", kUsage);
  TORCH_CHECK(!a.ep || (a.pp == 1 && a.greedy == 0 && (a.dp == 1 || a.tp == 1) && !a.ddp),
              "--ep runs with --tp or --dp (FSDP) only. ", kUsage);
  TORCH_CHECK(a.tp == 1 || a.ep, "--tp is for --ep (other layouts take tp = WORLD_SIZE / dp). ", kUsage);
  return a;
}

at::Tensor tensorIn(const std::string& path, const std::string& name) {
  at::Tensor found;
  for (auto& [k, t] : io::load_safetensors(path).tensors)
    if (k == name) found = t;
  TORCH_CHECK(found.defined(), "no tensor '", name, "' in ", path, ". Write it with llama_reference.py.");
  return found;
}

// The one dtype of every tensor in the folder's model*.safetensors files:
// what the export writes, so it can be compared bit for bit.
at::ScalarType folderDtype(const std::string& dir) {
  std::optional<at::ScalarType> dtype;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("model", 0) != 0 || entry.path().extension() != ".safetensors") continue;
    for (auto& [k, t] : io::load_safetensors(entry.path().string()).tensors) {
      if (!dtype) dtype = t.scalar_type();
      TORCH_CHECK(*dtype == t.scalar_type(), "mixed dtypes for ", k, " in ", name, ": got ",
                  t.scalar_type(), ", expected ", *dtype, " as the tensors before it. Use a one-dtype folder.");
    }
  }
  TORCH_CHECK(dtype, "no model*.safetensors in '", dir, "'.");
  return *dtype;
}

// Builds the model in `dtype`, parallelizes it on `mesh` as dtp-train does
// (TP over "tp", then FSDP over "dp" when dp > 1; no mesh on one rank),
// loads the folder's weights at that layout and returns it.
Llama loadAt(const Args& a, const std::optional<DeviceMesh>& mesh, int64_t dp, at::ScalarType dtype) {
  LlamaConfig c = llama_config_from_hf(a.model_dir);
  c.dtype = dtype;
  Llama model(c);
  if (mesh) {
    apply_tensor_parallel(model, *mesh, TensorParallelOptions{/*sequence_parallel=*/false});
    if (dp > 1 && a.ddp) apply_ddp(model, *mesh);
    else if (dp > 1) apply_fsdp(model, *mesh);
  }
  load_hf_weights(model, a.model_dir);
  return model;
}

at::Tensor logitsOf(Llama& model, const at::Tensor& ids) {
  at::NoGradGuard no_grad;
  at::Tensor logits = model(ids);
  return is_dtensor(logits) ? full_tensor(logits) : logits;
}

// --pp: the mean loss of a float64 GPipe pipeline on the tokens shifted by one.
int runPipeline(const Args& a, ProcessGroup& world) {
  const int64_t W = world.size(), tp = W / a.pp;
  TORCH_CHECK(a.pp * tp == W, "--pp ", a.pp, " does not divide WORLD_SIZE=", W, ". Choose a divisor.");
  const DeviceMesh mesh = tp > 1 ? init_device_mesh("cpu", {a.pp, tp}, {"pp", "tp"})
                                 : init_device_mesh("cpu", {a.pp}, {"pp"});
  const at::Tensor ids = tensorIn(a.reference, "input_ids");
  LlamaConfig c = llama_config_from_hf(a.model_dir);
  c.dtype = at::kDouble;
  Llama model(c);
  load_hf_weights(model, a.model_dir);
  PipelineOptions po;
  po.schedule = "gpipe";
  po.microbatches = static_cast<int>(ids.size(0));
  LlamaPipeline pipe = pipeline_llama(model, mesh, po);
  at::Tensor loss = pipe.pipeline->step(ids, ids.roll(-1, 1));
  if (pipe.has_last_stage) {
    if (is_dtensor(loss)) loss = full_tensor(loss);
    if (world.rank() % tp == 0) {
      io::save_safetensors(a.out, {{"loss_f64", loss.detach().reshape({})}});
      std::printf("hf_check: pp=%lld tp=%lld: loss %.17g written to %s\n", static_cast<long long>(a.pp),
                  static_cast<long long>(tp), loss.item<double>(), a.out.c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

// --greedy: new tokens of each sequence, float64, KV cache, inference plan.
at::Tensor greedyAt(const Args& a, const std::optional<DeviceMesh>& mesh, const at::Tensor& ids) {
  LlamaConfig c = llama_config_from_hf(a.model_dir);
  c.dtype = at::kDouble;
  Llama model(c);
  if (mesh) apply_tensor_parallel_for_inference(model, *mesh);
  load_hf_weights(model, a.model_dir);
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t b = 0; b < ids.size(0); ++b) {
    const at::Tensor row = ids[b].contiguous();
    prompts.emplace_back(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
  }
  GenerateOptions o;
  o.max_new_tokens = a.greedy;
  const auto out = generate(model, prompts, o);
  at::Tensor tokens = at::empty({ids.size(0), a.greedy}, at::kLong);
  for (size_t b = 0; b < out.size(); ++b) {
    TORCH_CHECK(static_cast<int64_t>(out[b].size()) == a.greedy, "greedy: sequence ", b, " got ", out[b].size(),
                " tokens, expected ", a.greedy, " (no stop tokens were given).");
    for (int64_t t = 0; t < a.greedy; ++t) tokens[b][t] = out[b][t];
  }
  return tokens;
}

// save_hf of the float32 model to EXPORT_DIR, in the folder's dtype.
void exportAt(const Args& a, Llama& f32, const ProcessGroup& world, const std::string& layout) {
  // 20000 bytes: a few tensors per file, so the index and the split are
  // exercised as save_pretrained would split a large model.
  HFSaveOptions options;
  options.dtype = folderDtype(a.model_dir);
  options.max_shard_bytes = 20000;
  options.source_dir = a.model_dir;
  save_hf(f32, a.export_dir, options);
  if (world.rank() == 0) {
    int files = 0;
    for (const auto& entry : fs::directory_iterator(a.export_dir))
      files += entry.path().extension() == ".safetensors";
    std::printf("hf_check: %s: exported in %s to %s (%d files)\n", layout.c_str(), c10::toString(*options.dtype),
                a.export_dir.c_str(), files);
    std::fflush(stdout);
  }
}

// --ep: the experts spread over ep; every data-parallel rank (ep, or dp x ep)
// its own sequence, tp ranks the same one.
int runExpertParallel(const Args& a, ProcessGroup& world) {
  const int64_t W = world.size(), ep = W / (a.dp * a.tp);
  TORCH_CHECK(ep * a.dp * a.tp == W, "--ep: --dp ", a.dp, " x --tp ", a.tp, " does not divide WORLD_SIZE=", W, ".");
  const DeviceMesh mesh = a.tp > 1   ? init_device_mesh("cpu", {ep, a.tp}, {"ep", "tp"})
                          : a.dp > 1 ? init_device_mesh("cpu", {a.dp, ep}, {"dp", "ep"})
                                     : init_device_mesh("cpu", {W}, {"ep"});
  const at::Tensor ids = tensorIn(a.reference, "input_ids");
  const int64_t batch = ids.size(0);
  TORCH_CHECK(W / a.tp >= batch, "--ep needs at least one data-parallel rank per sequence: ", batch, " sequences, ",
              W / a.tp, " ranks.");
  auto sequenceOf = [&](int64_t rank) { return (rank / a.tp) % batch; };
  std::vector<int64_t> first(batch, -1);  // each sequence from the first rank that fed it
  for (int64_t r = W - 1; r >= 0; --r) first[sequenceOf(r)] = r;
  io::TensorMap out;
  for (at::ScalarType dtype : {at::kDouble, at::kFloat}) {
    LlamaConfig c = llama_config_from_hf(a.model_dir);
    c.dtype = dtype;
    Llama model(c);
    if (a.tp > 1) {
      apply_expert_parallel(model, mesh["ep"]);
      apply_tensor_parallel(model, mesh["tp"], TensorParallelOptions{/*sequence_parallel=*/false});
    } else if (a.dp > 1) {
      parallelize_llama(model, mesh);
    } else {
      apply_expert_parallel(model, mesh);
    }
    load_hf_weights(model, a.model_dir);
    at::NoGradGuard no_grad;
    at::Tensor mine = model(ids.narrow(0, sequenceOf(world.rank()), 1));
    if (is_dtensor(mine)) mine = full_tensor(mine);
    const std::vector<int64_t> ones(W, 1);
    const at::Tensor all = world.all_gather(mine.contiguous(), 0, ones).wait();
    out.emplace_back(dtype == at::kDouble ? "logits_f64" : "logits_f32",
                     all.index_select(0, at::tensor(first, at::kLong)).contiguous());
    if (dtype == at::kFloat) exportAt(a, model, world, mesh.str());
  }
  if (world.rank() == 0) {
    io::save_safetensors(a.out, out);
    std::printf("hf_check: %s: logits of %s written to %s\n", mesh.str().c_str(), a.model_dir.c_str(), a.out.c_str());
    std::fflush(stdout);
  }
  return 0;
}

int run(const Args& a) {
  ProcessGroup world = init_process_group();
  if (a.pp > 1) return runPipeline(a, world);
  if (a.ep) return runExpertParallel(a, world);
  const int64_t W = world.size(), dp = a.dp, tp = W / dp;
  TORCH_CHECK(dp * tp == W, "--dp ", dp, " does not divide WORLD_SIZE=", W,
              ". Choose --dp a divisor of the number of ranks.");
  const bool root = world.rank() == 0;
  std::optional<DeviceMesh> mesh;
  if (dp > 1) mesh = init_device_mesh("cpu", {dp, tp}, {"dp", "tp"});
  else if (tp > 1) mesh = init_device_mesh("cpu", {tp}, {"tp"});

  const at::Tensor ids = tensorIn(a.reference, "input_ids");
  Llama f64 = loadAt(a, mesh, dp, at::kDouble);
  const at::Tensor logits_f64 = logitsOf(f64, ids);
  at::Tensor aux;
  if (f64->config.moe.num_experts > 0) {
    aux = moe_load_balancing_loss(f64).detach();
    if (is_dtensor(aux)) aux = full_tensor(aux);
  }
  Llama f32 = loadAt(a, mesh, dp, at::kFloat);
  const at::Tensor logits_f32 = logitsOf(f32, ids);
  std::vector<std::pair<std::string, at::Tensor>> out = {{"logits_f64", logits_f64}, {"logits_f32", logits_f32}};
  if (a.greedy > 0) out.emplace_back("greedy_f64", greedyAt(a, mesh, ids));
  if (aux.defined()) out.emplace_back("aux_f64", aux.reshape({}));
  if (root) {
    io::save_safetensors(a.out, out);
    std::printf("hf_check: dp=%lld tp=%lld: logits %s of %s written to %s\n", static_cast<long long>(dp),
                static_cast<long long>(tp), c10::str(logits_f64.sizes()).c_str(), a.model_dir.c_str(),
                a.out.c_str());
    std::fflush(stdout);
  }

  exportAt(a, f32, world, c10::str("dp=", dp, " tp=", tp));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parseArgs(argc, argv));
  } catch (const c10::Error& e) {
    std::cerr << "hf_check: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "hf_check: " << e.what() << std::endl;
    return 1;
  }
}
