// A mixture-of-experts SwiGLU feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE) for the
// reference decoder, dropless, with expert parallelism over an "ep" mesh
// dimension (NOTE: [Expert parallelism] in src/models/moe.cpp).
#pragma once

#include "dtp/device_mesh.h"
#include "dtp/nn/modules.h"
#include "dtp/tp/style.h"

#include <memory>
#include <optional>
#include <vector>

namespace dtp::models {

struct MoEConfig {
  int64_t num_experts = 0;     // 0: a dense SwiGLU MLP in every block
  int64_t top_k = 2;           // experts per token
  int64_t hidden = 0;          // each expert's SwiGLU width (HF's moe_intermediate_size)
  // Routing weights: softmax over all experts, the top_k kept, renormalized
  // to sum 1 when norm_topk_prob (Mixtral always, which equals a softmax
  // over the top_k logits; Qwen3-MoE's norm_topk_prob).
  bool norm_topk_prob = true;
  double aux_loss_coef = 0.0;  // router_aux_loss_coef: moe_load_balancing_loss's weight in training
  // > 0: a shared expert of this SwiGLU width runs on every token, gated by
  // sigmoid(shared_expert_gate(x)) (Qwen2-MoE's shared_expert_intermediate_size).
  int64_t shared_hidden = 0;
};

// The shared expert: a dense SwiGLU MLP, w2 (silu(w1 x) * w3 x), that every
// token passes through beside its routed experts. Under TP it is cut like
// the dense MLP (llama_tp_plan: w1, w3 column-, w2 row-parallel).
class SharedExpertImpl : public torch::nn::Module {
 public:
  SharedExpertImpl(int64_t dim, int64_t hidden);
  at::Tensor forward(const at::Tensor& x);
  dtp::nn::Linear w1{nullptr}, w2{nullptr}, w3{nullptr};
};
DTP_MODULE(SharedExpert);

// The experts, stacked: expert e is w2[e] (silu(w1[e] x) * w3[e] x). A module
// of its own (torchtitan's GroupedExperts), so that data parallelism can
// treat the experts apart from the rest of the layer (NOTE: [Expert
// parallelism with data parallelism] in src/models/llama_ep.cpp).
class GroupedExpertsImpl : public torch::nn::Module {
 public:
  GroupedExpertsImpl(int64_t dim, int64_t hidden, int64_t num_experts);
  // Rows [sum(counts[:e]), +counts[e]) of `x` [rows, dim] go to local expert
  // e (this rank's experts, in order); experts with no rows are skipped.
  at::Tensor forward(const at::Tensor& x, const std::vector<int64_t>& counts);

  at::Tensor w1, w2, w3;  // [E, hidden, dim], [E, dim, hidden], [E, hidden, dim]
  // Set by ExpertTensorParallel: w1 and w3 are Shard(1) and w2 Shard(2) over
  // this mesh (each expert's hidden units cut), so outputs are partial sums.
  std::optional<DeviceMesh> tp_mesh;
};
DTP_MODULE(GroupedExperts);

// The load-balancing loss's gradient for one layer's router probabilities
// (NOTE: [Load-balancing loss gradient] in src/models/llama_ep.cpp).
struct AuxLossGrad {
  at::Tensor per_prob;  // [E]: d loss / d probs[t, e], the same for every token t
  at::Tensor upstream;  // the loss's gradient, set by its backward (undefined: not in this backward)
};

// Each token goes to its top_k experts and comes back as their outputs
// weighted by its routing weights; every routed token is computed (no
// capacity, nothing dropped).
class MoEImpl : public torch::nn::Module {
 public:
  MoEImpl(int64_t dim, const MoEConfig& config);
  // x [batch, seq, dim] -> [batch, seq, dim]. Plain, or a replicated DTensor
  // (under TP the experts are replicated: every tp rank computes them).
  at::Tensor forward(const at::Tensor& x);

  MoEConfig config;
  dtp::nn::Linear gate{nullptr};  // the router: dim -> num_experts, no bias
  GroupedExperts experts{nullptr};
  // With config.shared_hidden > 0: output += sigmoid(shared_expert_gate(x)) * shared_expert(x).
  SharedExpert shared_expert{nullptr};
  dtp::nn::Linear shared_expert_gate{nullptr};  // dim -> 1, no bias
  // Set by apply_expert_parallel: the experts are Shard(0) over this mesh
  // (1-D, "ep") and tokens travel to their experts' ranks.
  std::optional<DeviceMesh> ep_mesh;
  // Of the last forward, for moe_load_balancing_loss: the router's
  // probabilities [tokens, E], each token's experts [tokens, top_k], and the
  // mesh the input was replicated over (TP), if any.
  at::Tensor router_probs, selected;
  std::optional<DeviceMesh> input_mesh;
  // The last forward's (a checkpoint's recomputation keeps the first pass's).
  std::shared_ptr<AuxLossGrad> aux_grad = std::make_shared<AuxLossGrad>();
  // While keep_routing is set (LlamaPipeline::add_load_balancing_loss),
  // every training forward (with grad, or a checkpoint's first pass; not an
  // evaluation's, nor a recomputation) appends its routing: the
  // routed slots [top_k, E], the probabilities summed over tokens [E], the
  // tokens, and its aux_grad (a pipeline step's microbatches, for one loss
  // over all of them).
  struct Routing {
    at::Tensor routed, prob_sums;
    int64_t tokens = 0;
    std::shared_ptr<AuxLossGrad> grad;
  };
  bool keep_routing = false;
  std::vector<Routing> routing;
};
DTP_MODULE(MoE);

// Expert parallelism of one MoE layer over the 1-D mesh `ep`: experts.w1,
// w2, w3 become Shard(0) (experts [r E/P, (r+1) E/P) on ep rank r) and forward
// dispatches tokens by all-to-all (NOTE: [Expert parallelism]).
// apply_expert_parallel does this for every MoE layer of a model.
void distribute_experts(MoEImpl& moe, const DeviceMesh& ep);

// distribute_experts as a parallel style, for plans over an ep mesh:
//   parallelize_module(*model, mesh["ep"], {{"layers.*.moe", ExpertParallel()}});
// A plan entry matching anything but a MoE module is an error naming it.
class ExpertParallel : public ParallelStyle {
 public:
  void apply(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
             std::optional<int> src_data_rank) const override;
  std::string name() const override { return "ExpertParallel"; }
};

// Tensor parallelism inside every expert, the alternative to expert
// parallelism (torchtitan's TensorParallel for GroupedExperts): over a 1-D
// tp mesh, each expert's w1 and w3 are column-parallel (Shard(1): its hidden
// units) and w2 row-parallel (Shard(2)), so every tp rank computes a part of
// every routed token's expert output and the MoE layer returns a
// Partial(sum) DTensor, reduced by the plan's output layout. The layer's
// input must be replicated over the same mesh (llama_tp_plan gathers it):
//   parallelize_module(*model, mesh["tp"], {{"layers.*.moe.experts", ExpertTensorParallel()}});
class ExpertTensorParallel : public ParallelStyle {
 public:
  void apply(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
             std::optional<int> src_data_rank) const override;
  std::string name() const override { return "ExpertTensorParallel"; }
};

}  // namespace dtp::models
