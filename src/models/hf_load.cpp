// Loading a Hugging Face Llama folder onto any layout: each rank reads only
// the rows and columns of its shards (NOTE: [Bounded box IO]), permuting q/k
// rows per NOTE: [Rotary layouts].
#include "dtp/models/hf_llama.h"

#include "comm/error_text.h"
#include "dcp/pieces.h"
#include "dtp/dtensor.h"
#include "dtp/io/box_io.h"
#include "dtp/module_utils.h"
#include "models/agree_on_mesh.h"
#include "models/hf_common.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/grad_mode.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <filesystem>
#include <fstream>
#include <set>
#include <unordered_map>

namespace dtp::models {
namespace {

namespace fs = std::filesystem;

// The folder's tensors: name -> file, from the index or the single file.
class HFFolder {
 public:
  explicit HFFolder(std::string dir) : dir_(std::move(dir)) {
    const std::string index = dir_ + "/model.safetensors.index.json";
    if (fs::exists(index)) {
      std::ifstream in(index);
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(in);
        for (const auto& [name, file] : j.at("weight_map").items()) where_[name] = file.get<std::string>();
      } catch (const nlohmann::json::exception& e) {
        TORCH_CHECK(false, "load_hf_weights: '", index, "' is not a valid index (", e.what(),
                    "): expected {\"weight_map\": {tensor: file}}. Re-download or re-export the model.");
      }
      return;
    }
    const std::string single = dir_ + "/model.safetensors";
    TORCH_CHECK(fs::exists(single), "load_hf_weights: '", dir_, "' has neither model.safetensors nor "
                "model.safetensors.index.json. Pass a Hugging Face folder with safetensors weights (pytorch_model.bin "
                "is NYI: convert it with safetensors' convert script).");
    for (const auto& t : file("model.safetensors").tensors()) where_[t.name] = "model.safetensors";
  }

  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [name, f] : where_) out.push_back(name);
    return out;
  }
  bool has(const std::string& name) const { return where_.count(name) > 0; }
  const io::SafetensorsFile& file_of(const std::string& name) { return file(where_.at(name)); }

 private:
  const io::SafetensorsFile& file(const std::string& name) {
    auto it = open_.find(name);
    if (it == open_.end()) it = open_.emplace(name, std::make_unique<io::SafetensorsFile>(dir_ + "/" + name)).first;
    return *it->second;
  }
  std::string dir_;
  std::map<std::string, std::string> where_;
  std::map<std::string, std::unique_ptr<io::SafetensorsFile>> open_;
};

// Hands the heap's free memory back to the system. Building the model on
// the meta device still allocates each block (then drops it), and the load's
// read buffers come and go: glibc keeps such memory for reuse (up to 64 MiB
// at the top of the heap, and every hole below), which showed as 0.14 GB
// resident above the kept weights per rank for a dim-2048 model at TP=2.
void releaseFreedMemory() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

bool isFloat(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf || t == at::kDouble;
}

using LinearImpl = nn::HookedImpl<torch::nn::LinearImpl>;

// The Linear layers to_weight_only converts, by their weight's FQN. See its
// comment in hf_llama.h for what stays in the model's dtype.
std::map<std::string, std::pair<std::string, LinearImpl*>> weightOnlyLinears(Llama& model) {
  std::map<std::string, std::pair<std::string, LinearImpl*>> out;
  for (const auto& item : model->named_modules("", /*include_self=*/false)) {
    auto* linear = dynamic_cast<LinearImpl*>(item.value().get());
    if (linear == nullptr) continue;
    const std::string& fqn = item.key();
    const std::string leaf = fqn.substr(fqn.rfind('.') + 1);
    if (leaf == "gate" || leaf == "shared_expert_gate") continue;  // MoE routers
    out[fqn + ".weight"] = {fqn, linear};
  }
  return out;
}

}  // namespace

void to_weight_only(Llama& model, const nn::WeightOnlyOptions& options) {
  for (auto& [weight, linear] : weightOnlyLinears(model)) nn::to_weight_only(*linear.second, options, linear.first);
}

void load_hf_weights(Llama& model, const std::string& dir, const HFLoadOptions& options) {
  agree_on_mesh(*model, "load_hf_weights", "folders", dir);
  HFFolder folder(dir);
  auto tensors = hf_tensors(model);  // not const: a converted weight's float shard is dropped
  // Names first, all of them at once.
  std::vector<std::string> missing, unexpected;
  std::set<std::string> expected;
  for (const auto& t : tensors) {
    expected.insert(t.hf);
    if (!folder.has(t.hf)) missing.push_back(t.hf);
  }
  for (const auto& name : folder.names()) {
    const bool harmless = name.size() > 21 && name.compare(name.size() - 21, 21, "rotary_emb.inv_freq") == 0;
    if (!expected.count(name) && !harmless) unexpected.push_back(name);
  }
  TORCH_CHECK(missing.empty() && unexpected.empty(), "load_hf_weights: '", dir,
              "' does not hold the tensors this Llama needs:",
              missing.empty() ? "" : "\n  missing: " + name_list(missing),
              unexpected.empty() ? "" : "\n  unexpected: " + name_list(unexpected),
              "\nBuild the model from this folder's config (llama_config_from_hf)",
              model->config.tie_embeddings ? "; tie_word_embeddings is true, so lm_head.weight must be absent" : "",
              ".");
  // Deferred init: nothing to load into yet.
  std::vector<std::string> on_meta;
  for (const auto& t : tensors) {
    if (dcp::local_box(t.param).local.is_meta()) on_meta.push_back(t.fqn);
  }
  TORCH_CHECK(on_meta.empty(), "load_hf_weights: the model's parameters are on the meta device (deferred init: no "
              "memory yet): ", name_list(on_meta), ". Call init_weights(model) first; a load fills the parameters' "
              "memory in place.");
  // Shapes and dtypes, before anything changes.
  std::vector<const io::StoredTensor*> stored;
  for (const auto& t : tensors) {
    const io::StoredTensor& s = folder.file_of(t.hf).at(t.hf);
    const auto shape = hf_shape(t);
    TORCH_CHECK(s.shape == shape, "load_hf_weights: '", t.hf, "' in '", folder.file_of(t.hf).path(), "' has shape ",
                c10::IntArrayRef(s.shape), ", the model built from the config expects ", c10::IntArrayRef(shape),
                " (", t.fqn, "). config.json does not match the weights; fix it or rebuild the model from it.");
    TORCH_CHECK(isFloat(s.dtype), "load_hf_weights: '", t.hf, "' in '", folder.file_of(t.hf).path(), "' has dtype ",
                s.dtype, ". Supported: bfloat16, float16, float32, float64 (quantized weights are NYI).");
    stored.push_back(&s);
  }
  // Weight-only layers are read as floats, then converted (NOTE: [Weight-only linears]).
  const auto linears = weightOnlyLinears(model);
  for (const auto& [weight, linear] : linears) {
    TORCH_CHECK(!linear.second->weight_only, "load_hf_weights: '", linear.first, "' holds a weight-only weight (",
                linear.second->weight.scalar_type(), ") already. NYI: loading into converted layers; load the float "
                "model with HFLoadOptions::weight_only set, which converts each layer as it is read.");
  }
  torch::NoGradGuard no_grad;
  auto read = [&](size_t i) {
    dcp::LocalBox box = dcp::local_box(tensors[i].param);
    if (const int64_t e = tensors[i].expert; e >= 0) {  // one expert's slab of a stacked weight, if held here
      const int64_t first = box.offsets[0];
      if (e < first || e >= first + box.local.size(0)) return;
      box.local = box.local.select(0, e - first);
      box.offsets.erase(box.offsets.begin());
    }
    if (box.local.numel() == 0) return;
    std::vector<int64_t> start = box.offsets;
    for (const RowRun& run : row_runs(box.offsets[0], box.local.size(0), tensors[i].rope_head_dim)) {
      start[0] = run.hf_first;
      io::read_box(folder.file_of(tensors[i].hf), *stored[i], start, run_rows(box.local, run), options.buffer_bytes);
    }
  };
  for (size_t i = 0; i < tensors.size(); ++i) {
    read(i);
    if (!options.weight_only) continue;
    if (auto it = linears.find(tensors[i].fqn); it != linears.end()) {
      tensors[i].param = at::Tensor();  // the float shard goes with the conversion
      nn::to_weight_only(*it->second.second, *options.weight_only, it->second.first);
      // Back to the system at once: glibc keeps a freed shard below its
      // mmap threshold for reuse, and the float shards' pages would all stay
      // resident (measured: int8 at dim 1024 peaked at 0.94 GB, float32 at
      // 0.83 GB).
      releaseFreedMemory();
    }
  }
  // A tied head is not a tensor of its own in the folder: it becomes one
  // here, from the embedding just read (NOTE: [Weight-only linears]).
  if (options.weight_only) {
    for (const auto& [weight, linear] : linears) {
      if (!linear.second->weight_only) nn::to_weight_only(*linear.second, *options.weight_only, linear.first);
    }
  }
  // Every parameter now holds the folder's values: a deferred_init model
  // (its shards allocated by parallelizing, not yet set) needs no
  // init_weights, which would overwrite them (it refuses now).
  model->awaiting_init = false;
}

// See NOTE: [Loading only the shards] in hf_llama.h.
Llama load_hf_model(LlamaConfig config, const std::string& dir, const std::function<void(Llama&)>& parallelize,
                    const HFLoadOptions& options) {
  config.deferred_init = true;
  Llama model(config);
  if (parallelize) parallelize(model);
  {
    // What parallelizing left on the meta device (everything, on one
    // device) gets its memory here, unset: the load writes every element.
    // A tied parameter is allocated once and both entries take it.
    torch::NoGradGuard no_grad;
    std::unordered_map<const c10::TensorImpl*, at::Tensor> done;
    const auto modules = model->named_modules("", /*include_self=*/false);
    for (const auto& item : model->named_parameters()) {
      const at::Tensor& p = item.value();
      if (is_dtensor(p) || !p.is_meta()) continue;
      const auto dot = item.key().rfind('.');
      torch::nn::Module& owner = dot == std::string::npos ? *model : *modules[item.key().substr(0, dot)];
      const std::string name = dot == std::string::npos ? item.key() : item.key().substr(dot + 1);
      auto seen = done.find(p.unsafeGetTensorImpl());
      if (seen == done.end()) {
        at::Tensor empty = at::empty(p.sizes(), p.options().device(model->config.device));
        seen = done.emplace(p.unsafeGetTensorImpl(), empty.requires_grad_(p.requires_grad())).first;
      }
      set_parameter(owner, name, seen->second);
    }
  }
  releaseFreedMemory();
  load_hf_weights(model, dir, options);
  releaseFreedMemory();
  return model;
}

}  // namespace dtp::models
