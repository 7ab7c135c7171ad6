// apply_expert_parallel and the MoE load-balancing loss of a model.
#include "dtp/dtensor.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/parallel_dims.h"
#include "dtp/tp/parallelize.h"
#include "models/moe_layers.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

namespace dtp::models {
namespace {

// The loss's own node: its backward hands the gradient it receives to every
// layer (NOTE: [Load-balancing loss gradient]).
struct LoadBalancingLossBackward : torch::autograd::Node {
  std::vector<std::shared_ptr<AuxLossGrad>> layers;
  std::string name() const override { return "dtp::MoELoadBalancingLossBackward"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    for (auto& g : layers) g->upstream = grads[0].defined() ? grads[0].detach() : at::Tensor();
    return {};
  }
};

}  // namespace

std::vector<MoEImpl*> detail::moe_layers(Llama& model) {
  std::vector<MoEImpl*> out;
  if (!model->layers) return out;
  for (const auto& layer : *model->layers) {
    auto* block = layer->as<TransformerBlockImpl>();
    if (block->moe) out.push_back(block->moe.get());
  }
  return out;
}

void apply_expert_parallel(Llama& model, const DeviceMesh& mesh) {
  // "ep", or ParallelDims' "dp_shard_in_ep" (NOTE: [Mesh dimension names]).
  const ParallelMeshDims d = parallel_mesh_dims(mesh);
  TORCH_CHECK(d.ep, "apply_expert_parallel: ", mesh.str(), " has no \"ep\" dimension. Name the mesh dimension the "
              "experts are spread over \"ep\" (or build the mesh with ParallelDims().ep(n)).");
  const DeviceMesh ep = mesh.ndim() == 1 ? mesh : mesh[*d.ep];
  TORCH_CHECK(model->config.moe.num_experts > 0, "apply_expert_parallel: the model has no MoE layers (LlamaConfig::moe."
              "num_experts is 0). Build it with experts, or leave expert parallelism out.");
  parallelize_module(*model, ep, {{"layers.*.moe", ExpertParallel()}});  // distribute_experts checks E % ep
}

// NOTE: [Load-balancing loss gradient] The loss is
//   L = coef * scale * E * sum_e routed[e] / n * (sum over layers and tokens of probs[t, e]) / n
// with `routed` (slots per expert, over the top-k, the layers and the dp
// ranks) and n constants of the routing. So dL/dprobs[t, e] is
// coef * scale * E * routed[e] / n^2 for every layer and token: `per_prob`.
// Under activation checkpointing the first pass ran without grad, so the
// probabilities it kept have no graph; the recomputation in backward makes
// new ones. The gradient therefore enters where the recomputed graph is:
// every MoE output is output + z, z a zero whose backward node gives the
// layer's probabilities per_prob times the loss's own gradient (as
// Megatron's MoEAuxLossAutoScaler), which the loss's node hands to the
// layers when backward starts (it is created last, so the engine runs it
// before any layer's). The same path serves runs without checkpointing.
// A backward of a loss without this term gives the routers nothing of it.

// NOTE: [Load-balancing loss under context parallelism] One device's loss
// counts the routed slots and tokens of every position of the batch. A cp
// rank routes only its positions (NOTE: [Context parallelism in the Llama]),
// so its counts are summed over the model's cp group as over the data
// parallel one: one all_reduce of (routed [top_k, E], tokens) packed, per
// call, on top of data_parallel's two. The gradients are then averaged over
// dp x cp (FSDP or DDP over dp_shard x cp), so `scale` is dp x cp: every
// rank's term is scale times its positions' share of the whole batch's
// (sum_r prob_sums_r = one device's prob_sums), and the average over the
// dp x cp ranks, of the value and of the gradient, is one device's. The
// counts are integers, exact in floating point, so the sums are exact in any
// order. Without the sum over cp each cp rank would weigh its probabilities
// by its own positions' routed fractions: near one device's on average, but
// not equal (a HeadTail rank's positions route differently from its peer's),
// however the experts are spread (replicated, or over ep x cp).
namespace detail {

LoadBalancing load_balancing(const LlamaConfig& c, at::Tensor routed, at::Tensor tokens, const at::Tensor& prob_sums,
                             const std::optional<ProcessGroup>& data_parallel, const ContextParallelState* cp) {
  double scale = 1.0;
  if (data_parallel && data_parallel->size() > 1) {
    data_parallel->all_reduce(routed).wait();
    data_parallel->all_reduce(tokens).wait();
    scale = static_cast<double>(data_parallel->size());
  }
  // See NOTE: [Load-balancing loss under context parallelism].
  if (cp != nullptr && cp->group.size() > 1) {
    at::Tensor packed = at::cat({routed.flatten(), tokens});
    cp->group.all_reduce(packed).wait();
    routed = packed.narrow(0, 0, routed.numel()).view(routed.sizes());
    tokens = packed.narrow(0, routed.numel(), 1);
    scale *= static_cast<double>(cp->group.size());
  }
  // HF's load_balancing_loss_func on the layers' logits concatenated:
  // (routed slots per (k, e)) / N times (sum of probabilities per e) / N.
  const at::Tensor n = tokens.reshape({});
  const at::Tensor loss = ((routed / n) * (prob_sums / n).unsqueeze(0)).sum() * c.moe.num_experts;
  LoadBalancing out;
  out.value = (loss * (c.moe.aux_loss_coef * scale)).to(c.dtype);
  out.per_prob = routed.sum(0) / (n * n) * (c.moe.num_experts * c.moe.aux_loss_coef * scale);
  return out;
}

}  // namespace detail

at::Tensor moe_load_balancing_loss(Llama& model, const std::optional<ProcessGroup>& data_parallel) {
  const auto layers = detail::moe_layers(model);
  const LlamaConfig& c = model->config;
  if (layers.empty()) return at::zeros({}, at::TensorOptions().dtype(c.dtype).device(c.device));
  std::vector<at::Tensor> probs, masks;
  for (MoEImpl* moe : layers) {
    TORCH_CHECK(moe->router_probs.defined(), "moe_load_balancing_loss: no forward has run yet. Call it after the "
                "model's forward, before backward.");
    probs.push_back(moe->router_probs.detach());  // the gradient takes the path above
    masks.push_back(at::one_hot(moe->selected, c.moe.num_experts).to(moe->router_probs.scalar_type()));
  }
  const at::Tensor all_probs = at::cat(probs);
  const at::Tensor routed = at::cat(masks).sum(0).detach();  // [top_k, E]
  const detail::LoadBalancing lb =
      detail::load_balancing(c, routed, at::full({1}, static_cast<double>(all_probs.size(0)), routed.options()),
                             all_probs.sum(0), data_parallel, model->context_parallel.get());
  at::Tensor out = lb.value;
  auto node = std::make_shared<LoadBalancingLossBackward>();
  for (MoEImpl* moe : layers) {
    moe->aux_grad->per_prob = lb.per_prob.to(moe->router_probs.scalar_type());
    moe->aux_grad->upstream = at::Tensor();
    node->layers.push_back(moe->aux_grad);
  }
  if (at::GradMode::is_enabled()) {
    out = out.detach().clone();
    torch::autograd::set_history(out, node);
  }
  // Under TP every tp rank routed the same tokens with a replicated router:
  // the loss is replicated, to be added to loss_parallel's.
  if (const auto& mesh = layers[0]->input_mesh)
    out = from_local(out, *mesh, Placements(mesh->ndim(), Replicate()), /*run_check=*/false);
  return out;
}

// NOTE: [Load-balancing loss in a pipeline] HF's loss multiplies two sums
// over every layer and token of the batch: routed slots (constants of the
// routing) and router probabilities. Its gradient for one token's
// probabilities (per_prob) therefore needs every stage's and every
// microbatch's routed counts before any backward, which GPipe gives: the
// MoE layers keep each microbatch's routing (keep_routing), and a loss
// term of the pipeline (NOTE: [Pipeline loss terms]) sums them, all_reduces
// (routed, probability sums, tokens) packed over pp, then over the rows'
// group and cp as moe_load_balancing_loss does, and sets every kept
// microbatch's aux_grad: per_prob, and upstream 1 (the term is added once,
// unscaled by the microbatches). Each rank's term is then the same as
// moe_load_balancing_loss's on the whole model with the rank's rows: one
// device's, averaged over dp x cp. Under 1F1B a backward precedes the last
// forwards; Megatron's per-microbatch, per-layer form would be a different
// loss, so it is refused rather than approximated.
void LlamaPipeline::add_load_balancing_loss(const std::optional<ProcessGroup>& data_parallel) const {
  TORCH_CHECK(!stages.empty() && pipeline, "LlamaPipeline::add_load_balancing_loss: no stages on this rank. Call it on "
              "what pipeline_llama returned.");
  std::vector<MoEImpl*> layers;
  for (Llama stage : stages)
    for (MoEImpl* moe : detail::moe_layers(stage)) {
      moe->keep_routing = true;
      moe->routing.clear();
      layers.push_back(moe);
    }
  const LlamaConfig c = stages[0]->config;
  TORCH_CHECK(c.moe.num_experts > 0, "LlamaPipeline::add_load_balancing_loss: the model has no MoE layers "
              "(LlamaConfig::moe.num_experts is 0). Leave the load-balancing loss out.");
  const ProcessGroup pp = pipeline->group();
  std::shared_ptr<ContextParallelState> cp = stages[0]->context_parallel;
  pipeline->add_loss_term([layers, c, pp, data_parallel, cp]() {
    const int64_t E = c.moe.num_experts, k = c.moe.top_k;
    const auto f64 = at::TensorOptions().dtype(at::kDouble).device(c.device);
    at::Tensor routed = at::zeros({k, E}, f64), prob_sums = at::zeros({E}, f64);
    double tokens = 0;
    for (MoEImpl* moe : layers) {
      for (const MoEImpl::Routing& r : moe->routing) {
        routed += r.routed.to(at::kDouble);
        prob_sums += r.prob_sums.to(at::kDouble);
        tokens += static_cast<double>(r.tokens);
      }
    }
    at::Tensor packed = at::cat({routed.flatten(), prob_sums, at::full({1}, tokens, f64)});
    pp.all_reduce(packed).wait();
    const detail::LoadBalancing lb =
        detail::load_balancing(c, packed.narrow(0, 0, k * E).view({k, E}).clone(), packed.narrow(0, k * E + E, 1).clone(),
                               packed.narrow(0, k * E, E), data_parallel, cp.get());
    for (MoEImpl* moe : layers) {
      for (const MoEImpl::Routing& r : moe->routing) {
        r.grad->per_prob = lb.per_prob.to(r.prob_sums.scalar_type());
        r.grad->upstream = at::ones({}, r.prob_sums.options());
      }
      moe->routing.clear();
    }
    return lb.value;
  });
}

}  // namespace dtp::models
