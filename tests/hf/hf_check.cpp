// hf_check: the rank program of the Hugging Face interop test
// (run_hf_check.sh). One process per rank, under dtprun or torchrun:
//
//   dtprun -n 4 hf_check MODEL_DIR REFERENCE.safetensors OUT.safetensors EXPORT_DIR --dp 2
//
// - Reads input_ids from REFERENCE (written by llama_reference.py).
// - Builds the Llama of MODEL_DIR/config.json in float64, then in float32, at
//   (dp, tp) = (--dp, WORLD_SIZE / dp): TP without sequence parallelism,
//   then FSDP when dp > 1; loads MODEL_DIR's weights at that layout; runs the
//   tokens. Rank 0 writes logits_f64 and logits_f32 (full tensors) to OUT,
//   for compare_logits.py.
// - Exports the float32 model with save_hf to EXPORT_DIR in the dtype of
//   MODEL_DIR's files, split over several files, with MODEL_DIR as
//   source_dir, for compare_export.py. bf16, f16 and f32 weights are exact
//   in float32, so the export must reproduce them bit for bit.
// Rank 0 prints one line per step; an error exits 1 with its message.
#include "dtp/dtensor.h"
#include "dtp/io/safetensors.h"
#include "dtp/models/hf_llama.h"
#include "dtp/models/llama.h"
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
  int64_t dp = 1;
};

constexpr const char* kUsage =
    "usage: hf_check MODEL_DIR REFERENCE.safetensors OUT.safetensors EXPORT_DIR [--dp N]";

Args parseArgs(int argc, char** argv) {
  Args a;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--dp") {
      TORCH_CHECK(i + 1 < argc, "--dp needs a value. ", kUsage);
      const std::string value = argv[++i];
      char* end = nullptr;
      a.dp = std::strtoll(value.c_str(), &end, 10);
      TORCH_CHECK(*end == '\0' && a.dp > 0, "--dp must be a positive number, got '", value, "'.");
    } else {
      positional.push_back(arg);
    }
  }
  TORCH_CHECK(positional.size() == 4, "got ", positional.size(), " arguments, expected 4. ", kUsage);
  a.model_dir = positional[0];
  a.reference = positional[1];
  a.out = positional[2];
  a.export_dir = positional[3];
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
    if (dp > 1) apply_fsdp(model, *mesh);
  }
  load_hf_weights(model, a.model_dir);
  return model;
}

at::Tensor logitsOf(Llama& model, const at::Tensor& ids) {
  at::NoGradGuard no_grad;
  at::Tensor logits = model(ids);
  return is_dtensor(logits) ? full_tensor(logits) : logits;
}

int run(const Args& a) {
  ProcessGroup world = init_process_group();
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
  Llama f32 = loadAt(a, mesh, dp, at::kFloat);
  const at::Tensor logits_f32 = logitsOf(f32, ids);
  if (root) {
    io::save_safetensors(a.out, {{"logits_f64", logits_f64}, {"logits_f32", logits_f32}});
    std::printf("hf_check: dp=%lld tp=%lld: logits %s of %s written to %s\n", static_cast<long long>(dp),
                static_cast<long long>(tp), c10::str(logits_f64.sizes()).c_str(), a.model_dir.c_str(),
                a.out.c_str());
    std::fflush(stdout);
  }

  // 20000 bytes: a few tensors per file, so the index and the split are
  // exercised as save_pretrained would split a large model.
  HFSaveOptions options;
  options.dtype = folderDtype(a.model_dir);
  options.max_shard_bytes = 20000;
  options.source_dir = a.model_dir;
  save_hf(f32, a.export_dir, options);
  if (root) {
    int files = 0;
    for (const auto& entry : fs::directory_iterator(a.export_dir))
      files += entry.path().extension() == ".safetensors";
    std::printf("hf_check: dp=%lld tp=%lld: exported in %s to %s (%d files)\n", static_cast<long long>(dp),
                static_cast<long long>(tp), c10::toString(*options.dtype), a.export_dir.c_str(), files);
    std::fflush(stdout);
  }
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
