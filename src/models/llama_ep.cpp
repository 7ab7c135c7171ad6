// apply_expert_parallel and the MoE load-balancing loss of a model.
#include "dtp/dtensor.h"
#include "dtp/models/llama.h"
#include "dtp/tp/parallelize.h"

#include <ATen/ATen.h>

namespace dtp::models {
namespace {

std::vector<MoEImpl*> moeLayers(Llama& model) {
  std::vector<MoEImpl*> out;
  if (!model->layers) return out;
  for (const auto& layer : *model->layers) {
    auto* block = layer->as<TransformerBlockImpl>();
    if (block->moe) out.push_back(block->moe.get());
  }
  return out;
}

}  // namespace

void apply_expert_parallel(Llama& model, const DeviceMesh& mesh) {
  const auto names = mesh.mesh_dim_names();
  TORCH_CHECK(std::find(names.begin(), names.end(), "ep") != names.end(), "apply_expert_parallel: ", mesh.str(),
              " has no \"ep\" dimension. Name the mesh dimension the experts are spread over \"ep\".");
  const DeviceMesh ep = mesh.ndim() == 1 ? mesh : mesh["ep"];
  TORCH_CHECK(model->config.moe.num_experts > 0, "apply_expert_parallel: the model has no MoE layers (LlamaConfig::moe."
              "num_experts is 0). Build it with experts, or leave expert parallelism out.");
  parallelize_module(*model, ep, {{"layers.*.moe", ExpertParallel()}});  // distribute_experts checks E % ep
}

at::Tensor moe_load_balancing_loss(Llama& model, const std::optional<ProcessGroup>& data_parallel) {
  const auto layers = moeLayers(model);
  const LlamaConfig& c = model->config;
  if (layers.empty()) return at::zeros({}, at::TensorOptions().dtype(c.dtype).device(c.device));
  std::vector<at::Tensor> probs, masks;
  for (MoEImpl* moe : layers) {
    TORCH_CHECK(moe->router_probs.defined(), "moe_load_balancing_loss: no forward has run yet. Call it after the "
                "model's forward, before backward.");
    probs.push_back(moe->router_probs);
    masks.push_back(at::one_hot(moe->selected, c.moe.num_experts).to(moe->router_probs.scalar_type()));
  }
  // HF's load_balancing_loss_func on the layers' logits concatenated:
  // (routed slots per (k, e)) / N times (sum of probabilities per e) / N.
  const at::Tensor all_probs = at::cat(probs);
  const at::Tensor prob_sums = all_probs.sum(0);      // [E]
  at::Tensor routed = at::cat(masks).sum(0).detach();  // [top_k, E]
  at::Tensor tokens = at::full({1}, static_cast<double>(all_probs.size(0)), routed.options());
  double scale = 1.0;
  if (data_parallel && data_parallel->size() > 1) {
    data_parallel->all_reduce(routed).wait();
    data_parallel->all_reduce(tokens).wait();
    scale = static_cast<double>(data_parallel->size());
  }
  const at::Tensor n = tokens.reshape({});
  const at::Tensor loss = ((routed / n) * (prob_sums / n).unsqueeze(0)).sum() * c.moe.num_experts;
  at::Tensor out = (loss * (c.moe.aux_loss_coef * scale)).to(c.dtype);
  // Under TP every tp rank routed the same tokens with a replicated router:
  // the loss is replicated, to be added to loss_parallel's.
  if (const auto& mesh = layers[0]->input_mesh)
    out = from_local(out, *mesh, Placements(mesh->ndim(), Replicate()), /*run_check=*/false);
  return out;
}

}  // namespace dtp::models
