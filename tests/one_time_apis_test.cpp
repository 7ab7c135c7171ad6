// Misuse of the one-time collective APIs (issue 43): ranks that disagree
// where no collective would notice, loads that would half-apply or load
// nothing, options that match nothing, config values of another type. Each
// is an error naming the API, the argument and the fix; none changes state.
#include "dist.h"
#include "files.h"
#include "llama_util.h"

#include "comm/compat.h"
#include "dtp/comm_counter.h"
#include "dtp/dcp/checkpoint.h"
#include "dtp/dcp/step_folders.h"
#include "dtp/dtensor.h"
#include "dtp/io/box_io.h"
#include "dtp/io/safetensors_file.h"
#include "dtp/inference/sampling.h"
#include "dtp/models/generate.h"
#include "dtp/models/hf_llama.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/optim/adamw.h"

#include <ATen/CPUGeneratorImpl.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

using namespace dtp;
using namespace dtp::models;
using dtp::test::expect_error;
using dtp::test::kSeq;
using dtp::test::run_ranks;

namespace {

namespace fs = std::filesystem;

class OneTimeApisTest : public dtp::test::TempDirTest {};

LlamaConfig config() {
  LlamaConfig c = dtp::test::small_llama_config(2);
  c.dtype = at::kDouble;
  return c;
}

// generate with other prompts of the same length on each rank, or other
// options: named, each rank's value shown, before any token is computed.
TEST_F(OneTimeApisTest, GenerateRefusesRanksWithOtherPromptsOrOptions) {
  run_ranks(2, [&](int rank) {
    Llama model(config());
    apply_tensor_parallel_for_inference(model, init_device_mesh("cpu", {2}, {"tp"}));
    GenerateOptions o;
    o.max_new_tokens = 3;
    expect_error([&] { generate(model, {{1, 5, rank == 0 ? 7 : 8}}, o); },
                 {"generate: the ranks passed different prompts (token ids)", "rank 0: '[1, 5, 7]'",
                  "rank 1: '[1, 5, 8]'"});
    o.seed = rank;
    expect_error([&] { generate(model, {{1, 5, 7}}, o); },
                 {"generate: the ranks passed different options", "seed=0", "seed=1"});
    o.seed = 0;
    EXPECT_EQ(generate(model, {{1, 5, 7}}, o)[0].size(), 3u);
  });
}

// dcp::load or load_hf_weights of another folder on each rank: replicas
// would differ. Named.
TEST_F(OneTimeApisTest, LoadRefusesRanksWithOtherFolders) {
  run_ranks(2, [&](int rank) {
    Llama model(config());
    dcp::save_state(file("a"), *model, nullptr, {}, llama_state_dict_options());
    dcp::save_state(file("b"), *model, nullptr, {}, llama_state_dict_options());
    expect_error([&] { dcp::load_state(file(rank == 0 ? "a" : "b"), *model, nullptr, llama_state_dict_options()); },
                 {"dcp::load: the ranks passed different folders", "rank 0: '" + file("a") + "'",
                  "rank 1: '" + file("b") + "'"});
    Llama tp(config());
    apply_tensor_parallel(tp, init_device_mesh("cpu", {2}, {"tp"}), TensorParallelOptions{true, kSeq});
    save_hf(tp, file("hfa"));
    save_hf(tp, file("hfb"));
    expect_error([&] { load_hf_weights(tp, file(rank == 0 ? "hfa" : "hfb")); },
                 {"load_hf_weights: the ranks passed different folders", "rank 1: '" + file("hfb") + "'"});
  });
}

// Loading into a deferred-init model (parameters on the meta device) would
// load nothing: refused, naming init_weights, by dcp and by the HF loader.
TEST_F(OneTimeApisTest, LoadIntoMetaParametersNamesInitWeights) {
  Llama saved(config());
  dcp::save_state(file("ck"), *saved, nullptr, {}, llama_state_dict_options());
  save_hf(saved, file("hf"));
  LlamaConfig c = config();
  c.deferred_init = true;
  Llama lazy(c);
  expect_error([&] { dcp::load_state(file("ck"), *lazy, nullptr, llama_state_dict_options()); },
               {"meta device", "model.tok_embeddings.weight", "init_weights(model)"});
  expect_error([&] { load_hf_weights(lazy, file("hf")); }, {"load_hf_weights", "meta device", "init_weights(model)"});
  init_weights(lazy);
  dcp::load_state(file("ck"), *lazy, nullptr, llama_state_dict_options());
  EXPECT_TRUE(lazy->tok_embeddings->weight.equal(saved->tok_embeddings->weight));
}

// A load that fails its checks (an optimizer of another kind, a model of
// another size) leaves the optimizer's state as it was, not reset to zero.
TEST_F(OneTimeApisTest, FailedLoadLeavesTheOptimizerUntouched) {
  Llama model(config());
  auto opt = std::make_unique<dtp::optim::AdamW>(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
  dtp::test::train_llama(model, *opt, 0, 2);
  auto snapshot = [&] {
    std::vector<at::Tensor> out;
    for (auto& p : model->unique_parameters()) {
      auto& s = static_cast<torch::optim::AdamWParamState&>(*opt->state().at(compat::optimizer_state_key(p)));
      out.push_back(s.exp_avg().clone());
      out.push_back(at::scalar_tensor(s.step()));
    }
    return out;
  };
  const auto before = snapshot();
  LlamaConfig wide = config();
  wide.ffn_hidden = 96;
  Llama other(wide);
  auto other_opt = std::make_unique<dtp::optim::AdamW>(other->unique_parameters(), torch::optim::AdamWOptions(1e-2));
  dtp::test::train_llama(other, *other_opt, 0, 1);
  dcp::save_state(file("wide"), *other, other_opt.get(), {}, llama_state_dict_options());
  expect_error([&] { dcp::load_state(file("wide"), *model, opt.get(), llama_state_dict_options()); },
               {"other dtype or shape"});
  const auto after = snapshot();
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(after[i].equal(before[i])) << "optimizer state " << i;
  // Another optimizer kind: refused before anything.
  Llama plain(config());
  dcp::save_state(file("plain"), *plain, nullptr, {}, llama_state_dict_options());
  expect_error([&] { dcp::load_state(file("plain"), *model, opt.get(), llama_state_dict_options()); },
               {"holds no optimizer", "AdamW"});
  EXPECT_TRUE(snapshot()[0].equal(before[0]));
}

// StateDictOptions::keep that accepts nothing (a misspelt FQN) would save and
// load zero tensors without a word.
TEST_F(OneTimeApisTest, KeepThatMatchesNothingIsAnError) {
  Llama model(config());
  dcp::StateDictOptions o = llama_state_dict_options();
  o.keep = [](const std::string& fqn) { return fqn.rfind("layer.0.", 0) == 0; };  // "layers.0." misspelt
  expect_error([&] { dcp::get_model_state_dict(*model, o); },
               {"StateDictOptions::keep accepts none of the module's", "misspelt"});
  expect_error([&] { dcp::save_state(file("ck"), *model, nullptr, {}, o); }, {"accepts none"});
  EXPECT_FALSE(fs::exists(file("ck")));
  o.keep = [](const std::string& fqn) { return fqn.rfind("layers.0.", 0) == 0; };
  EXPECT_GT(dcp::get_model_state_dict(*model, o).tensors.size(), 0u);
}

// config.json values of another type are errors naming the file and key,
// never a conversion (32.9 read as 32) or a raw JSON library message.
TEST_F(OneTimeApisTest, HfConfigValuesOfAnotherTypeAreNamed) {
  fs::copy(std::string(DTP_TEST_DATA_DIR) + "/hf_tiny", file("hf"));
  const std::string path = file("hf") + "/config.json";
  const auto original = nlohmann::json::parse(std::ifstream(path));
  auto with = [&](const char* key, nlohmann::json value) {
    auto j = original;
    j[key] = value;
    std::ofstream(path) << j.dump();
  };
  with("hidden_size", 32.9);
  expect_error([&] { llama_config_from_hf(file("hf")); },
               {"llama_config_from_hf", "config.json", "\"hidden_size\" is 32.9, expected an integer"});
  with("tie_word_embeddings", "false");
  expect_error([&] { llama_config_from_hf(file("hf")); }, {"\"tie_word_embeddings\" is \"false\", expected a boolean"});
  with("attention_bias", "no");
  expect_error([&] { llama_config_from_hf(file("hf")); }, {"\"attention_bias\" is \"no\", expected a boolean"});
  with("model_type", 7);
  expect_error([&] { llama_config_from_hf(file("hf")); }, {"\"model_type\" is 7, expected a string"});
}

// A KVCache reused for a model of another dtype or head size, and a
// temperature too small for the logits: named, not raw ATen errors.
TEST_F(OneTimeApisTest, CacheReuseAndTinyTemperaturesAreNamed) {
  Llama model(config());
  KVCache cache(1, 16);
  at::NoGradGuard no_grad;
  cache.reset(1);
  model->forward(at::tensor({1, 5}, at::kLong).view({1, 2}), cache, {2});
  LlamaConfig f32 = config();
  f32.dtype = at::kFloat;
  Llama other(f32);
  cache.reset(1);
  expect_error([&] { other->forward(at::tensor({1, 5}, at::kLong).view({1, 2}), cache, {2}); },
               {"KVCache: layer 0 holds", "in Double", "this model's are", "in Float", "Build a KVCache for each model"});
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(0);
  const at::Tensor logits = at::tensor({1.0, 500.0, -3.0}, at::kDouble).view({1, 3});
  expect_error([&] { inference::sample(logits, {1e-310, 0, 1.0}, gen); }, {"temperature=1e-310 is subnormal"});
  expect_error([&] { inference::sample(logits, {1e-306, 0, 1.0}, gen); },
               {"softmax(logits / temperature=1e-306) is not finite", "Use temperature=0"});
  EXPECT_EQ(inference::sample(logits, {1e-3, 0, 1.0}, gen)[0], 1);
}

// The newer checkpoint helpers, one wrong use each: named, nothing changed.
TEST_F(OneTimeApisTest, CheckpointHelpersNameTheirMisuse) {
  expect_error([&] { dcp::step_folder(file("ck"), -1); }, {"step_folder: step -1 is negative"});
  expect_error([&] { dcp::remove_old_steps(file("ck"), 0); }, {"keep must be at least 1, got 0"});
  expect_error([&] { dcp::find_checkpoint(file("missing")); }, {"is not a complete checkpoint", "no index.json"});
  Llama model(config());
  torch::optim::AdamW foreign({at::zeros({2}, at::kDouble).requires_grad_()}, torch::optim::AdamWOptions(1e-2));
  expect_error([&] { dcp::get_optimizer_state_dict(*model, foreign); },
               {"the optimizer holds a parameter of shape [2] that the module does not have"});
  expect_error([&] { hf_name("layers.0.attention.wz.weight"); }, {"layers.0.attention.wz.weight"});
  EXPECT_TRUE(fs::is_empty(dir_));
}

// The rest of the newer public functions, one wrong use each.
TEST_F(OneTimeApisTest, NewerApisNameTheirMisuse) {
  Llama model(config());
  dcp::save_state(file("ck"), *model, nullptr, {}, llama_state_dict_options());
  dcp::StateDict wrong;
  wrong.add("model.norm.weight", at::zeros({3}, at::kDouble));
  expect_error([&] { dcp::load(wrong, file("ck"), {{}, 1 << 20, true, {"model.layers", "model.tok", "model.output"}}); },
               {"'model.norm.weight': saved Double[32], here Double[3]"});
  fs::create_directories(file("other"));
  dtp::test::write_bytes(file("other") + "/index.json", "{\"format\": \"someone-else\"}");
  expect_error([&] { dcp::read_index(file("other")); }, {"has format 'someone-else'", "not written by dtp"});
  auto opt = std::make_unique<dtp::optim::AdamW>(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
  expect_error([&] { dcp::set_optimizer_state_dict(*model, *opt, dcp::StateDict{}); }, {"the checkpoint holds no optimizer, but the optimizer given is AdamW"});
  torch::optim::AdamW foreign({at::zeros({2}, at::kDouble).requires_grad_()}, torch::optim::AdamWOptions(1e-2));
  expect_error([&] { dcp::init_optimizer_state(*model, foreign, {}); }, {"the optimizer holds a parameter of shape [2]"});
  KVCache cache(2, 8);
  expect_error([&] { cache.reset(3); }, {"KVCache: a batch of 3 sequences, but the cache holds"});
  const io::SafetensorsFile f(file("ck") + "/rank-00000.safetensors");
  const io::StoredTensor& norm = f.at("model.norm.weight");
  expect_error([&] { io::read_box(f, norm, {30}, at::empty({4}, at::kDouble)); },
               {"read_box: box start [30] size [4] is outside tensor 'model.norm.weight' of shape [32]"});
  expect_error([&] { io::CheckpointIndex::from_json("{\"format\": \"dtp-checkpoint-2\"}", "x/index.json"); },
               {"'x/index.json' has no \"checksum\" entry"});
}

// What the agreement check costs at one generate call: printed, not
// asserted (a benchmark's job); the per-op path never runs it.
TEST_F(OneTimeApisTest, AgreementCheckCostIsOneSmallExchangePerCall) {
  run_ranks(2, [&](int rank) {
    Llama model(config());
    apply_tensor_parallel_for_inference(model, init_device_mesh("cpu", {2}, {"tp"}));
    GenerateOptions o;
    o.max_new_tokens = 1;
    generate(model, {{1, 5, 7}}, o);
    CommCounter comm;
    generate(model, {{1, 5, 7}}, o);
    // Two agreements (prompts, options), each a length and a bytes all_gather.
    EXPECT_EQ(comm.count(CollectiveType::AllGather), 4 + 1) << comm.str();  // + greedy sampling's pair gather
    if (rank == 0) std::printf("one generate call: %s\n", comm.str().c_str());
  });
}

}  // namespace
