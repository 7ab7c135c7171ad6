// Export to a Hugging Face folder: rank 0 lays out the files and writes their
// headers, every rank pwrites the bytes of the shards it owns, rank 0 writes
// the index and config.json and commits the folder. Nothing is gathered.
#include "dtp/models/hf_llama.h"

#include "dcp/exchange.h"
#include "dcp/pieces.h"
#include "dtp/dtensor.h"
#include "dtp/io/box_io.h"
#include "dtp/io/safetensors.h"
#include "io/file_util.h"
#include "io/staged_dir.h"
#include "models/hf_common.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/grad_mode.h>
#include <unistd.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <optional>

namespace dtp::models {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

struct FileLayout {
  std::string name;
  std::vector<io::HeaderEntry> entries;
  std::string header;
  std::vector<uint64_t> begins;
  uint64_t size = 0;
};

// save_pretrained's split: tensors in order, a new file when the next one
// would pass the limit.
std::vector<FileLayout> layout(const std::vector<HFTensor>& tensors, at::ScalarType dtype, uint64_t max_bytes) {
  std::vector<FileLayout> files(1);
  uint64_t bytes = 0;
  for (const auto& t : tensors) {
    const auto shape = hf_shape(t);
    uint64_t n = c10::elementSize(dtype);
    for (int64_t s : shape) n *= static_cast<uint64_t>(s);
    if (bytes > 0 && bytes + n > max_bytes) {
      files.emplace_back();
      bytes = 0;
    }
    files.back().entries.push_back({t.hf, dtype, shape});
    bytes += n;
  }
  char name[64];
  for (size_t i = 0; i < files.size(); ++i) {
    std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", i + 1, files.size());
    files[i].name = files.size() == 1 ? "model.safetensors" : name;
    files[i].header = io::encode_safetensors_header(files[i].entries, {{"format", "pt"}}, &files[i].begins);
    files[i].size = files[i].header.size();
    for (const auto& e : files[i].entries) {
      uint64_t n = c10::elementSize(dtype);
      for (int64_t s : e.shape) n *= static_cast<uint64_t>(s);
      files[i].size += n;
    }
  }
  return files;
}

constexpr const char* kTokenizerFiles[] = {"tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                                           "special_tokens_map.json", "generation_config.json"};

// save_pretrained's names for the weights: "model.safetensors",
// "model-00001-of-00003.safetensors" and the index of the shards.
bool isModelFile(const std::string& name) {
  if (name == "model.safetensors" || name == "model.safetensors.index.json") return true;
  // model-DDDDD-of-DDDDD.safetensors
  if (name.size() != 32 || name.rfind("model-", 0) != 0 || name.compare(11, 4, "-of-") != 0 ||
      name.compare(20, 12, ".safetensors") != 0) {
    return false;
  }
  for (size_t i : {6, 7, 8, 9, 10, 15, 16, 17, 18, 19}) {
    if (!std::isdigit(static_cast<unsigned char>(name[i]))) return false;
  }
  return true;
}

// What an export writes: the weights, config.json, and the tokenizer files
// it copies from the source folder (only where the target has none).
bool isExportFile(const std::string& name) {
  if (isModelFile(name) || name == "config.json") return true;
  for (const char* t : kTokenizerFiles) {
    if (name == t) return true;
  }
  return false;
}

const char* dtypeName(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kDouble: return "float64";
    default: TORCH_CHECK(false, "save_hf: dtype ", t, " is not a weight dtype. Use float32, bfloat16, float16 or float64.");
  }
}

const char* architecture(const std::string& family) {
  if (family == "mistral") return "MistralForCausalLM";
  if (family == "mixtral") return "MixtralForCausalLM";
  if (family == "qwen3_moe") return "Qwen3MoeForCausalLM";
  if (family == "qwen2_moe") return "Qwen2MoeForCausalLM";
  if (family == "qwen2") return "Qwen2ForCausalLM";
  if (family == "qwen3") return "Qwen3ForCausalLM";
  TORCH_CHECK(family == "llama", "save_hf: LlamaConfig::family is '", family,
              "'. Use one of llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe (NOTE: [Model families]).");
  return "LlamaForCausalLM";
}

// The switches must be what the family's config.json can say (NOTE: [Model
// families]), or the export would not load as what was trained.
void checkFamily(const LlamaConfig& c) {
  architecture(c.family);
  if (c.family == "qwen2_moe") {
    TORCH_CHECK(!c.o_bias, "save_hf: a qwen2_moe model has no o bias (its q/k/v biases follow qkv_bias); this one has "
                "o_bias=true. Set LlamaConfig::family to match the switches.");
  } else if (c.family == "qwen2") {
    TORCH_CHECK(c.qkv_bias && !c.o_bias, "save_hf: a qwen2 model has q/k/v biases and no o bias; this one has "
                "qkv_bias=", c.qkv_bias, ", o_bias=", c.o_bias, ". Set LlamaConfig::family to match the switches.");
  } else {
    TORCH_CHECK(c.qkv_bias == c.o_bias, "save_hf: ", c.family, "'s attention_bias covers q, k, v and o together; "
                "this model has qkv_bias=", c.qkv_bias, ", o_bias=", c.o_bias, ". Use family \"qwen2\" for q/k/v "
                "biases alone.");
  }
  const bool qwen3 = c.family == "qwen3" || c.family == "qwen3_moe";
  TORCH_CHECK(c.qk_norm == qwen3, "save_hf: qk_norm=", c.qk_norm, " with family \"", c.family,
              "\": per-head q/k norms are qwen3's and qwen3_moe's alone. Set LlamaConfig::family to match the "
              "switches.");
  const bool moe = c.family == "mixtral" || c.family == "qwen2_moe" || c.family == "qwen3_moe";
  TORCH_CHECK((c.moe.num_experts > 0) == moe, "save_hf: moe.num_experts=", c.moe.num_experts, " with family \"",
              c.family, "\": mixtures of experts are mixtral's, qwen2_moe's and qwen3_moe's. Set LlamaConfig::family "
              "to match.");
  TORCH_CHECK((c.moe.shared_hidden > 0) == (c.family == "qwen2_moe"), "save_hf: moe.shared_hidden=",
              c.moe.shared_hidden, " with family \"", c.family, "\": a shared expert is qwen2_moe's alone, and every "
              "qwen2_moe block has one. Set LlamaConfig::family to match.");
  TORCH_CHECK(c.family != "mixtral" || c.moe.norm_topk_prob, "save_hf: mixtral renormalizes its top-k weights; "
              "this model has moe.norm_topk_prob=false.");
  TORCH_CHECK((c.family != "mistral" && c.family != "mixtral") || !c.qkv_bias, "save_hf: ", c.family,
              "'s attention has no biases; this model has "
              "qkv_bias=true. Use family \"llama\" (attention_bias) or \"qwen2\".");
  TORCH_CHECK(c.sliding_window == 0 || c.family == "mistral" || c.family == "mixtral", "save_hf: sliding_window=",
              c.sliding_window, " with family \"", c.family, "\": only mistral's and mixtral's configs have a window "
              "on every layer.");
}

// config.json as the family's transformers config writes it (NOTE: [Model
// families]); the source's other fields (bos/eos ids, ...) are kept.
Json configJson(const LlamaConfig& c, at::ScalarType dtype, const std::string& source_dir) {
  const bool moe = c.moe.num_experts > 0;
  Json j = Json::object();
  if (!source_dir.empty() && fs::exists(source_dir + "/config.json")) {
    const std::string path = source_dir + "/config.json";
    std::ifstream in(path);
    try {
      j = Json::parse(in);
    } catch (const Json::exception& e) {
      TORCH_CHECK(false, "save_hf: the source's config.json '", path, "' (HFSaveOptions::source_dir) is not valid "
                  "JSON: ", e.what(), ". Fix or replace that file, or leave source_dir empty to write a config.json "
                  "from the model's config alone.");
    }
    TORCH_CHECK(j.is_object(), "save_hf: the source's config.json '", path, "' (HFSaveOptions::source_dir) is ",
                j.type_name(), ", expected a JSON object. Fix or replace that file, or leave source_dir empty.");
  }
  j["architectures"] = {architecture(c.family)};
  j["model_type"] = c.family;
  j["hidden_size"] = c.dim;
  j["intermediate_size"] = c.hidden();
  j["num_attention_heads"] = c.n_heads;
  j["num_key_value_heads"] = c.n_kv_heads;
  j["num_hidden_layers"] = c.n_layers;
  j["head_dim"] = c.head_dim();
  j["rms_norm_eps"] = c.norm_eps;
  j["vocab_size"] = c.vocab_size;
  j["tie_word_embeddings"] = c.tie_embeddings;
  j["max_position_embeddings"] = c.max_seq_len;
  j["hidden_act"] = "silu";
  if (c.family == "llama" || c.family == "qwen3" || c.family == "qwen3_moe") j["attention_bias"] = c.qkv_bias;
  if (c.family == "llama") j["mlp_bias"] = false;
  if (c.family == "mistral" || c.family == "mixtral")
    j["sliding_window"] = c.sliding_window > 0 ? Json(c.sliding_window) : Json();
  if (c.family == "mixtral") {
    j["num_local_experts"] = c.moe.num_experts;
    j["intermediate_size"] = c.moe.hidden;
  } else if (c.family == "qwen2_moe" || c.family == "qwen3_moe") {
    j["num_experts"] = c.moe.num_experts;
    j["moe_intermediate_size"] = c.moe.hidden;
    j["norm_topk_prob"] = c.moe.norm_topk_prob;
    j["decoder_sparse_step"] = 1;
    j["mlp_only_layers"] = Json::array();
  }
  if (c.family == "qwen2_moe") {
    j["shared_expert_intermediate_size"] = c.moe.shared_hidden;
    j["qkv_bias"] = c.qkv_bias;
  }
  if (moe) {
    j["num_experts_per_tok"] = c.moe.top_k;
    j["router_aux_loss_coef"] = c.moe.aux_loss_coef;
  }
  Json scaling;  // null: none
  if (c.rope_scaling.factor > 0) {
    scaling = {{"rope_type", "llama3"},
               {"factor", c.rope_scaling.factor},
               {"low_freq_factor", c.rope_scaling.low_freq_factor},
               {"high_freq_factor", c.rope_scaling.high_freq_factor},
               {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
  }
  if (j.contains("rope_parameters")) {  // transformers 5's form: theta and scaling in one object
    Json rope = scaling.is_null() ? Json{{"rope_type", "default"}} : scaling;
    rope["rope_theta"] = c.rope_theta;
    j["rope_parameters"] = rope;
  } else {
    j["rope_theta"] = c.rope_theta;
    j["rope_scaling"] = scaling;
  }
  j["torch_dtype"] = dtypeName(dtype);
  return j;
}

}  // namespace

void save_hf(Llama& model, const std::string& dir, const HFSaveOptions& options) {
  const auto group = dcp::checkpoint_group(options.group);
  const int rank = group ? group->rank() : 0;
  const std::string what = "save_hf of '" + dir + "'", folder = io::incomplete_dir(dir);
  agree_on_value(group, "save_hf", "folders", dir);
  checkFamily(model->config);
  const at::ScalarType dtype = options.dtype.value_or(model->config.dtype);
  const auto tensors = hf_tensors(model);
  for (const auto& item : model->named_modules("", /*include_self=*/false)) {
    const auto* linear = dynamic_cast<const nn::HookedImpl<torch::nn::LinearImpl>*>(item.value().get());
    TORCH_CHECK(linear == nullptr || !linear->weight_only, "save_hf: NYI: '", item.key(), "' holds a weight-only "
                "weight (", linear == nullptr ? at::kFloat : linear->weight.scalar_type(), ", converted for "
                "inference: int8 quantized, or a tied head stored apart from the embedding). Save the float "
                "model, or reload it without weight_only.");
  }
  std::vector<FileLayout> files;
  // NOTE: [Nothing dtp did not write]: the export joins the folder's other
  // entries; only its own older shards go.
  std::optional<io::StagedDir> staged;
  Json config;
  // Rank 0 lays out the files: headers written, data zero-filled. The
  // source's config.json is read first: a bad one fails before any byte.
  dcp::agree(group, dcp::error_of([&] {
    dtypeName(dtype);
    files = layout(tensors, dtype, options.max_shard_bytes);
    if (rank != 0) return;
    config = configJson(model->config, dtype, options.source_dir);
    staged.emplace(dir, isExportFile, io::StagedDir::Mode::kMerge, "save_hf");
    for (const auto& f : files) {
      const std::string path = folder + "/" + f.name;
      int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      TORCH_CHECK(fd >= 0, "cannot create '", path, "': ", io::errno_text(), ".");
      const bool ok = io::write_all(fd, f.header.data(), f.header.size()) &&
                      ::ftruncate(fd, static_cast<off_t>(f.size)) == 0;
      const std::string err = io::errno_text();
      ::close(fd);
      TORCH_CHECK(ok, "writing '", path, "' failed: ", err, ". Check free disk space.");
    }
  }), what);

  // Every rank writes the bytes it owns: its shards, replicas by the lowest
  // rank holding them (dcp's rule), q/k rows permuted back to HF's layout.
  dcp::agree(group, dcp::error_of([&] {
    dcp::StateDict sd;
    std::map<std::string, std::pair<size_t, size_t>> where;  // hf name -> (file, entry)
    std::map<std::string, int64_t> rope;
    std::map<std::string, std::vector<std::string>> experts;  // stacked fqn -> each expert's HF name
    for (const auto& t : tensors) {
      if (t.expert < 0) {
        sd.add(t.hf, t.param), rope[t.hf] = t.rope_head_dim;
        continue;
      }
      auto& names = experts[t.fqn];
      if (names.empty()) sd.add(t.fqn, t.param);
      names.resize(std::max<size_t>(names.size(), t.expert + 1));
      names[t.expert] = t.hf, rope[t.hf] = 0;
    }
    for (size_t f = 0; f < files.size(); ++f) {
      for (size_t e = 0; e < files[f].entries.size(); ++e) where[files[f].entries[e].name] = {f, e};
    }
    dcp::SavePlan plan = dcp::plan_save(sd);
    dcp::keep_lowest_holders(plan.pieces, group, rank);
    // A stacked expert weight's piece holds experts offsets[0].. : one
    // piece per expert, under that expert's HF name.
    std::vector<dcp::LocalPiece> pieces;
    for (auto& piece : plan.pieces) {
      auto it = experts.find(piece.name);
      if (it == experts.end()) {
        pieces.push_back(std::move(piece));
        continue;
      }
      for (int64_t i = 0; i < piece.data.size(0); ++i) {
        pieces.push_back({it->second.at(piece.offsets[0] + i), piece.data[i],
                          std::vector<int64_t>(piece.offsets.begin() + 1, piece.offsets.end())});
      }
    }
    plan.pieces = std::move(pieces);
    std::map<size_t, int> fds;
    try {
      torch::NoGradGuard no_grad;
      for (const auto& piece : plan.pieces) {
        const auto [f, e] = where.at(piece.name);
        const std::string path = folder + "/" + files[f].name;
        if (!fds.count(f)) {
          fds[f] = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
          TORCH_CHECK(fds[f] >= 0, "cannot open '", path, "': ", io::errno_text(),
                      ". Every rank must see the folder (a shared filesystem across machines).");
        }
        const auto& entry = files[f].entries[e];
        io::StoredTensor stored{entry.name, dtype, entry.shape, files[f].begins[e], 0, ""};
        std::vector<int64_t> start = piece.offsets;
        for (const RowRun& run : row_runs(piece.offsets[0], piece.data.size(0), rope.at(piece.name))) {
          start[0] = run.hf_first;
          io::write_box(fds[f], path, stored, start, run_rows(piece.data, run));
        }
      }
      for (auto& [f, fd] : fds) {
        TORCH_CHECK(::fsync(fd) == 0, "fsync of '", files[f].name, "' failed: ", io::errno_text(), ".");
      }
    } catch (...) {
      for (auto& [f, fd] : fds) ::close(fd);
      throw;
    }
    for (auto& [f, fd] : fds) ::close(fd);
  }), what);

  // Rank 0: the index, config.json, the source's tokenizer files; commit.
  dcp::agree(group, rank != 0 ? "" : dcp::error_of([&] {
    if (files.size() > 1) {
      Json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", Json::object()}};
      uint64_t total = 0;
      for (const auto& f : files) {
        total += f.size - f.header.size();
        for (const auto& e : f.entries) index["weight_map"][e.name] = f.name;
      }
      index["metadata"]["total_size"] = total;
      io::write_file_synced(folder + "/model.safetensors.index.json", index.dump(2) + "\n");
    }
    io::write_file_synced(folder + "/config.json", config.dump(2) + "\n");
    // The source's tokenizer files, unless the folder has its own (kept).
    for (const char* extra : kTokenizerFiles) {
      const fs::path from = fs::path(options.source_dir) / extra;
      if (options.source_dir.empty() || !fs::exists(from) || fs::exists(fs::path(dir) / extra)) continue;
      fs::copy_file(from, fs::path(folder) / extra);
    }
    staged->commit(/*stale=*/isModelFile);
  }), what);
}

}  // namespace dtp::models
