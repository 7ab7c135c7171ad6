// Hugging Face Llama folders (tests/data/hf_tiny*, made by tests/hf/*.py to
// HF's published LlamaForCausalLM semantics): logits equal the Python
// reference at TP=1, 2, 4 and under FSDP and DDP; export reproduces the files bit for
// bit; bad folders are named errors.
#include "dist.h"
#include "files.h"

#include "dtp/dtensor.h"
#include "dtp/io/safetensors.h"
#include "dtp/models/hf_llama.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

using namespace dtp;
using namespace dtp::models;
using dtp::test::expect_error;
using dtp::test::run_ranks;

namespace {

namespace fs = std::filesystem;

const std::string kData = DTP_TEST_DATA_DIR;

std::map<std::string, at::Tensor> tensorsOf(const std::string& path) {
  std::map<std::string, at::Tensor> out;
  for (auto& [name, t] : io::load_safetensors(path).tensors) out[name] = t;
  return out;
}

// Every tensor of a HF folder (single file or sharded), by name.
std::map<std::string, at::Tensor> folderTensors(const std::string& dir) {
  std::map<std::string, at::Tensor> out;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("model", 0) == 0 && entry.path().extension() == ".safetensors") {
      for (auto& [k, t] : tensorsOf(entry.path().string())) out[k] = t;
    }
  }
  return out;
}

struct Layout {
  int64_t dp, tp;
  bool ddp = false;  // dp > 1: FSDP, or DDP
};

// The logits of `dir`'s model on the reference tokens at `l` (dp > 1: FSDP),
// in `dtype`, as a full tensor.
at::Tensor logitsAt(const std::string& dir, Layout l, at::ScalarType dtype) {
  LlamaConfig c = llama_config_from_hf(dir);
  c.dtype = dtype;
  const at::Tensor ids = tensorsOf(dir + "/reference_logits.safetensors").at("input_ids");
  at::Tensor out;
  auto body = [&] {
    Llama model(c);
    if (l.dp * l.tp > 1) {
      auto mesh = init_device_mesh("cpu", {l.dp, l.tp}, {"dp", "tp"});
      apply_tensor_parallel(model, mesh, TensorParallelOptions{false});
      if (l.dp > 1 && !l.ddp) apply_fsdp(model, mesh);
      if (l.dp > 1 && l.ddp) apply_ddp(model, mesh);
    }
    load_hf_weights(model, dir);
    at::NoGradGuard no_grad;
    at::Tensor logits = model(ids);
    return is_dtensor(logits) ? full_tensor(logits) : logits;
  };
  if (l.dp * l.tp == 1) return body();
  std::mutex mu;
  run_ranks(static_cast<int>(l.dp * l.tp), [&](int rank) {
    at::Tensor logits = body();
    std::lock_guard<std::mutex> lock(mu);
    if (rank == 0) out = logits;
  });
  return out;
}

double maxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// Float64: the same function as HF's up to float64 rounding (the rope row
// permutation is exact). Float32: NOTE: [Float32 parity tolerance] in
// tests/llama_test.cpp: no further from the float64 reference than 4x the
// reference's own float32 distance (HF's float32 computation), plus 16 ulps
// of the logits' scale.
TEST(HfLlamaTest, LogitsEqualTheHfReferenceAtEveryLayout) {
  for (const char* name : {"hf_tiny", "hf_tiny_tied"}) {
    SCOPED_TRACE(name);
    const std::string dir = kData + "/" + name;
    const auto ref = tensorsOf(dir + "/reference_logits.safetensors");
    const at::Tensor want = ref.at("logits_f64");
    const LlamaConfig c = llama_config_from_hf(dir);
    std::vector<Layout> layouts = {{1, 1}, {1, 2}, {2, 2}, {2, 2, true}};
    if (c.n_kv_heads % 4 == 0) layouts.push_back({1, 4});
    for (Layout l : layouts) {
      const std::string where = "dp=" + std::to_string(l.dp) + " tp=" + std::to_string(l.tp) + (l.ddp ? " DDP" : "");
      const double f64 = maxAbsDiff(logitsAt(dir, l, at::kDouble), want);
      EXPECT_LE(f64, 1e-12) << where << " float64";
      const double refErr = maxAbsDiff(ref.at("logits_f32"), want);
      const double tol = 4 * refErr + 16 * 5.96e-8 * want.abs().max().item<double>();
      const double f32 = maxAbsDiff(logitsAt(dir, l, at::kFloat), want);
      EXPECT_LE(f32, tol) << where << " float32 (HF's own float32: " << refErr << ")";
      std::printf("%s %s: max |logits - HF float64|: float64 %.2g, float32 %.2g (HF's own float32 %.2g, bound %.2g)\n",
                  name, where.c_str(), f64, f32, refErr, tol);
    }
  }
}

class HfExportTest : public dtp::test::TempDirTest {};

// Loaded at (dp, tp) = (2, 2) under FSDP and exported in the file's dtype:
// the same tensors, bit for bit, split over files as asked, with the index,
// and config.json carrying the source's extra fields.
TEST_F(HfExportTest, ExportReproducesTheFilesBitForBit) {
  for (const char* name : {"hf_tiny", "hf_tiny_tied"}) {
    SCOPED_TRACE(name);
    const std::string src = kData + "/" + name, out = file(std::string(name) + "_out");
    const LlamaConfig c = llama_config_from_hf(src);
    const auto original = folderTensors(src);
    const at::ScalarType fileDtype = original.begin()->second.scalar_type();
    run_ranks(4, [&](int) {
      Llama model(c);  // float32: holds bf16 and f32 weights exactly
      auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
      apply_tensor_parallel(model, mesh, TensorParallelOptions{true, 12});
      apply_fsdp(model, mesh);
      load_hf_weights(model, src);
      HFSaveOptions o;
      o.dtype = fileDtype;
      o.max_shard_bytes = 20000;  // several files
      o.source_dir = src;
      save_hf(model, out, o);
    });
    const auto exported = folderTensors(out);
    ASSERT_EQ(exported.size(), original.size());
    for (const auto& [k, t] : original) {
      ASSERT_TRUE(exported.count(k)) << k;
      EXPECT_EQ(exported.at(k).scalar_type(), t.scalar_type()) << k;
      EXPECT_TRUE(exported.at(k).equal(t)) << k << " differs";
    }
    EXPECT_TRUE(fs::exists(out + "/model.safetensors.index.json"));
    int files = 0;
    for (const auto& e : fs::directory_iterator(out)) files += e.path().filename().string().rfind("model-0", 0) == 0;
    EXPECT_GE(files, 2) << "max_shard_bytes should split the export";
    std::ifstream in(out + "/config.json");
    const auto config = nlohmann::json::parse(in);
    EXPECT_EQ(config.at("bos_token_id"), 1);
    EXPECT_EQ(config.at("tie_word_embeddings"), c.tie_embeddings);
    const LlamaConfig back = llama_config_from_hf(out);
    EXPECT_EQ(back.n_kv_heads, c.n_kv_heads);
    EXPECT_EQ(back.hidden(), c.hidden());
  }
}

// Bad folders: each error names the tensor or file and the fix, and leaves
// the model as it was.
TEST_F(HfExportTest, BadFoldersAreNamedErrors) {
  const std::string src = kData + "/hf_tiny";
  auto copy = [&](const std::string& name) {
    const std::string d = file(name);
    fs::copy(src, d);
    return d;
  };
  auto editConfig = [&](const std::string& d, const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j;
    {
      std::ifstream in(d + "/config.json");
      j = nlohmann::json::parse(in);
    }
    edit(j);
    std::ofstream(d + "/config.json") << j.dump(2);
  };
  auto loadInto = [&](const std::string& d, const LlamaConfig& c, const std::vector<std::string>& parts) {
    Llama model(c);
    const at::Tensor before = model->norm->weight.detach().clone();
    expect_error([&] { load_hf_weights(model, d); }, parts);
    EXPECT_TRUE(model->norm->weight.equal(before)) << "changed by a failed load";
  };
  const LlamaConfig c = llama_config_from_hf(src);
  // A tensor missing from the index and one it does not expect.
  {
    const std::string d = copy("names");
    nlohmann::json j;
    {
      std::ifstream in(d + "/model.safetensors.index.json");
      j = nlohmann::json::parse(in);
    }
    const std::string file = j["weight_map"]["model.norm.weight"];
    j["weight_map"].erase("model.norm.weight");
    j["weight_map"]["model.layers.0.self_attn.q_proj.bias"] = file;
    std::ofstream(d + "/model.safetensors.index.json") << j.dump(2);
    loadInto(d, c, {"missing: model.norm.weight", "unexpected: model.layers.0.self_attn.q_proj.bias"});
  }
  // Tied in the config but lm_head present.
  {
    LlamaConfig tied = c;
    tied.tie_embeddings = true;
    loadInto(src, tied, {"unexpected: lm_head.weight", "tie_word_embeddings is true"});
  }
  // A config that disagrees with the weights.
  {
    LlamaConfig wide = c;
    wide.ffn_hidden = 72;
    loadInto(src, wide, {"'model.layers.0.mlp.gate_proj.weight'", "has shape [64, 32]", "expects [72, 32]",
                         "config.json does not match the weights"});
  }
  // An integer weight.
  {
    const std::string d = file("ints");
    fs::create_directories(d);
    fs::copy_file(src + "/config.json", d + "/config.json");
    io::TensorMap all;
    for (auto& [k, t] : folderTensors(src)) all.emplace_back(k, k == "model.norm.weight" ? t.to(at::kInt) : t);
    io::save_safetensors(d + "/model.safetensors", all, {{"format", "pt"}}, /*checksums=*/false);
    loadInto(d, c, {"'model.norm.weight'", "has dtype Int", "Supported: bfloat16, float16, float32, float64"});
  }
  // A truncated file.
  {
    const std::string d = copy("cut");
    const std::string f = d + "/model-00002-of-00002.safetensors";
    fs::resize_file(f, fs::file_size(f) - 64);
    loadInto(d, c, {"model-00002-of-00002.safetensors", "truncated"});
  }
  // No weights at all.
  {
    const std::string d = file("empty");
    fs::create_directories(d);
    Llama model(c);
    expect_error([&] { load_hf_weights(model, d); }, {"neither model.safetensors nor model.safetensors.index.json"});
  }
  // Configs dtp cannot run.
  {
    const std::string d = copy("scaled");
    editConfig(d, [](nlohmann::json& j) { j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}}; });
    expect_error([&] { llama_config_from_hf(d); }, {"rope_scaling", "no \"low_freq_factor\""});
    editConfig(d, [](nlohmann::json& j) { j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}}; });
    expect_error([&] { llama_config_from_hf(d); }, {"NYI", "rope_scaling", "\"yarn\"", "\"default\" and \"llama3\""});
    editConfig(d, [](nlohmann::json& j) { j["rope_scaling"] = {{"type", "dynamic"}, {"factor", 2.0}}; });
    expect_error([&] { llama_config_from_hf(d); }, {"NYI", "rope_scaling", "\"dynamic\""});
    editConfig(d, [](nlohmann::json& j) { j["rope_scaling"] = nullptr; j["model_type"] = "gemma"; });
    expect_error([&] { llama_config_from_hf(d); }, {"model_type 'gemma'", "supported are \"llama\"", "\"qwen3_moe\""});
    editConfig(d, [](nlohmann::json& j) { j["model_type"] = "llama"; j["hidden_act"] = "gelu"; });
    expect_error([&] { llama_config_from_hf(d); }, {"NYI", "hidden_act=\"gelu\"", "SwiGLU"});
    editConfig(d, [](nlohmann::json& j) { j["hidden_act"] = "silu"; j["model_type"] = "qwen2"; j["use_sliding_window"] = true; });
    expect_error([&] { llama_config_from_hf(d); }, {"NYI", "use_sliding_window=true", "max_window_layers"});
    editConfig(d, [](nlohmann::json& j) {
      j["use_sliding_window"] = false;
      j["layer_types"] = {"full_attention", "sliding_attention"};
    });
    expect_error([&] { llama_config_from_hf(d); }, {"NYI", "layer_types", "\"full_attention\""});
    editConfig(d, [](nlohmann::json& j) { j.erase("layer_types"); j["partial_rotary_factor"] = 0.5; });
    expect_error([&] { llama_config_from_hf(d); }, {"NYI", "partial_rotary_factor=0.5"});
    // A qwen2 config read as such expects q/k/v biases the llama weights lack.
    editConfig(d, [](nlohmann::json& j) { j.erase("partial_rotary_factor"); });
    EXPECT_TRUE(llama_config_from_hf(d).qkv_bias);
    EXPECT_FALSE(llama_config_from_hf(d).o_bias);
    {
      Llama model(llama_config_from_hf(d));
      expect_error([&] { load_hf_weights(model, d); }, {"missing: ", "model.layers.0.self_attn.q_proj.bias"});
    }
    editConfig(d, [](nlohmann::json& j) { j["model_type"] = "llama"; j.erase("hidden_size"); });
    expect_error([&] { llama_config_from_hf(d); }, {"no \"hidden_size\""});
  }
}

}  // namespace
