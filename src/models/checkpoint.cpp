#include "dtp/models/checkpoint.h"

#include "comm/compat.h"
#include "dtp/dtensor.h"
#include "dtp/io/safetensors.h"
#include "dtp/process_group.h"

#include <ATen/ATen.h>

namespace dtp::models {
namespace {

constexpr const char* kFormat = "dtp-llama-1";

// The config fields that fix tensor shapes, as checkpoint metadata.
std::map<std::string, std::string> shapeFields(const LlamaConfig& c) {
  return {{"vocab_size", std::to_string(c.vocab_size)}, {"dim", std::to_string(c.dim)},
          {"n_layers", std::to_string(c.n_layers)},     {"n_heads", std::to_string(c.n_heads)},
          {"n_kv_heads", std::to_string(c.n_kv_heads)}, {"ffn_hidden", std::to_string(c.hidden())},
          {"tie_embeddings", c.tie_embeddings ? "1" : "0"}};
}

at::Tensor full(const at::Tensor& t) { return is_dtensor(t) ? full_tensor(t.detach()) : t.detach(); }

// `value` (full) laid out like `like`: this rank's shard for a DTensor.
at::Tensor like(const at::Tensor& value, const at::Tensor& like) {
  if (!is_dtensor(like)) return value.to(like.scalar_type()).clone();
  return distribute_tensor(value.to(like.scalar_type()), device_mesh(like), placements(like),
                           /*src_data_rank=*/std::nullopt);
}

// One device without a process group counts as rank 0 (default_process_group
// throws when there is none).
bool isRankZero() { return !is_initialized() || default_process_group().rank() == 0; }

void checkNoAmsgrad(const torch::optim::AdamW& optimizer) {
  for (const auto& g : optimizer.param_groups()) {
    TORCH_CHECK(!static_cast<const torch::optim::AdamWOptions&>(g.options()).amsgrad(),
                "dtp checkpoints: NYI: AdamW with amsgrad (max_exp_avg_sq is not saved). Use amsgrad(false).");
  }
}

}  // namespace

void save_checkpoint(const std::string& path, Llama& model, torch::optim::AdamW& optimizer, int64_t step) {
  checkNoAmsgrad(optimizer);
  io::TensorMap tensors;
  auto& state = optimizer.state();
  for (auto& [name, p] : model->unique_named_parameters()) {
    tensors.emplace_back("model." + name, full(p));
    auto it = state.find(compat::optimizer_state_key(p));
    if (it == state.end()) continue;
    auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
    tensors.emplace_back("adamw." + name + ".exp_avg", full(s.exp_avg()));
    tensors.emplace_back("adamw." + name + ".exp_avg_sq", full(s.exp_avg_sq()));
    tensors.emplace_back("adamw." + name + ".step", at::scalar_tensor(s.step(), at::kLong));
  }
  auto meta = shapeFields(model->config);
  meta["format"] = kFormat;
  meta["step"] = std::to_string(step);
  // Rank 0 writes; every rank learns whether it worked (no rank waits for a
  // writer that failed).
  std::string error;
  if (isRankZero()) {
    try {
      io::save_safetensors(path, tensors, meta);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  if (is_initialized()) {
    at::Tensor failed = at::full({1}, error.empty() ? 0 : 1, at::kInt);
    default_process_group().all_reduce(failed, ReduceOp::Max);
    TORCH_CHECK(failed.item<int>() == 0, error.empty() ? "save_checkpoint: rank 0 could not write '" + path +
                                                             "'; its error says why."
                                                       : error);
  }
  TORCH_CHECK(error.empty(), error);
}

int64_t load_checkpoint(const std::string& path, Llama& model, torch::optim::AdamW* optimizer) {
  io::Checkpoint ck = io::load_safetensors(path);
  auto metaOf = [&](const std::string& key) -> std::string {
    auto it = ck.metadata.find(key);
    TORCH_CHECK(it != ck.metadata.end(), "load_checkpoint: '", path, "' has no '", key,
                "' metadata; it was not written by dtp's save_checkpoint.");
    return it->second;
  };
  TORCH_CHECK(metaOf("format") == kFormat, "load_checkpoint: '", path, "' has format '", metaOf("format"),
              "', expected '", kFormat, "'.");
  for (const auto& [field, value] : shapeFields(model->config)) {
    TORCH_CHECK(metaOf(field) == value, "load_checkpoint: '", path, "' holds a model with ", field, "=",
                metaOf(field), " but this model has ", field, "=", value,
                ". Pass the same model size options as the run that saved it.");
  }
  const std::string step_text = metaOf("step");
  size_t parsed = 0;
  int64_t step = 0;
  try {
    step = std::stoll(step_text, &parsed);
  } catch (const std::exception&) {
    parsed = 0;
  }
  TORCH_CHECK(parsed > 0 && parsed == step_text.size(), "load_checkpoint: '", path, "' has step '", step_text,
              "', expected an integer. The file is corrupt; re-save it or load the previous checkpoint.");
  std::map<std::string, at::Tensor> by_name(ck.tensors.begin(), ck.tensors.end());
  auto take = [&](const std::string& key, const at::Tensor& want) {
    auto it = by_name.find(key);
    TORCH_CHECK(it != by_name.end(), "load_checkpoint: '", path, "' lacks tensor '", key, "'.");
    const auto expected = is_dtensor(want) ? dtensor_spec(want).shape : want.sizes().vec();
    TORCH_CHECK(it->second.sizes().vec() == expected, "load_checkpoint: tensor '", key, "' in '", path,
                "' has shape ", it->second.sizes(), ", the model expects ", c10::IntArrayRef(expected), ".");
    return it->second;
  };
  // Check everything before changing anything.
  const auto params = model->unique_named_parameters();
  const bool with_state = optimizer && by_name.count("adamw." + params.front().first + ".exp_avg");
  if (optimizer) checkNoAmsgrad(*optimizer);
  for (auto& [name, p] : params) {
    take("model." + name, p);
    if (!with_state) continue;
    take("adamw." + name + ".exp_avg", p);
    take("adamw." + name + ".exp_avg_sq", p);
    auto it = by_name.find("adamw." + name + ".step");
    TORCH_CHECK(it != by_name.end(), "load_checkpoint: '", path, "' lacks tensor 'adamw.", name, ".step'.");
    TORCH_CHECK(it->second.numel() == 1, "load_checkpoint: tensor 'adamw.", name, ".step' in '", path,
                "' has shape ", it->second.sizes(), ", expected one value (the AdamW step count).");
  }

  torch::NoGradGuard no_grad;
  for (auto& [name, p] : params) {
    p.copy_(like(take("model." + name, p), p));
    if (optimizer && !with_state) optimizer->state().erase(compat::optimizer_state_key(p));  // saved before step 1
    if (!with_state) continue;
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->exp_avg(like(take("adamw." + name + ".exp_avg", p), p));
    s->exp_avg_sq(like(take("adamw." + name + ".exp_avg_sq", p), p));
    s->step(by_name.at("adamw." + name + ".step").item<int64_t>());
    optimizer->state()[compat::optimizer_state_key(p)] = std::move(s);
  }
  return step;
}

}  // namespace dtp::models
