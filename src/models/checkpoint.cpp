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

bool isRankZero() {
  ProcessGroup pg = default_process_group();
  return !pg.valid() || pg.rank() == 0;
}

}  // namespace

void save_checkpoint(const std::string& path, Llama& model, torch::optim::AdamW& optimizer, int64_t step) {
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
  if (isRankZero()) io::save_safetensors(path, tensors, meta);
  if (ProcessGroup pg = default_process_group(); pg.valid()) pg.barrier();
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
  for (auto& [name, p] : params) {
    take("model." + name, p);
    if (!with_state) continue;
    take("adamw." + name + ".exp_avg", p);
    take("adamw." + name + ".exp_avg_sq", p);
    TORCH_CHECK(by_name.count("adamw." + name + ".step"), "load_checkpoint: '", path, "' lacks tensor 'adamw.",
                name, ".step'.");
  }

  torch::NoGradGuard no_grad;
  for (auto& [name, p] : params) {
    p.copy_(like(take("model." + name, p), p));
    if (!with_state) continue;
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->exp_avg(like(take("adamw." + name + ".exp_avg", p), p));
    s->exp_avg_sq(like(take("adamw." + name + ".exp_avg_sq", p), p));
    s->step(by_name.at("adamw." + name + ".step").item<int64_t>());
    optimizer->state()[compat::optimizer_state_key(p)] = std::move(s);
  }
  return std::stoll(metaOf("step"));
}

}  // namespace dtp::models
