// The mixture-of-experts feed-forward: routing, dropless expert compute and
// the token dispatch of expert parallelism.
#include "dtp/models/moe.h"

#include "dtp/ac/activation_checkpoint.h"
#include "dtp/dtensor.h"
#include "dtp/ep/all_to_all.h"
#include "dtp/module_utils.h"
#include "nn/applied.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

namespace dtp::models {
namespace {

// A zero whose backward gives the router probabilities the load-balancing
// loss's gradient (NOTE: [Load-balancing loss gradient]).
struct AuxLossGradBackward : torch::autograd::Node {
  std::shared_ptr<AuxLossGrad> grad;
  std::vector<int64_t> probs_shape;
  std::string name() const override { return "dtp::MoEAuxLossGradBackward"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& /*grads*/) override {
    if (!grad->per_prob.defined() || !grad->upstream.defined()) return {at::Tensor()};
    return {(grad->per_prob * grad->upstream.to(grad->per_prob.scalar_type())).expand(probs_shape).contiguous()};
  }
};

at::Tensor auxLossGradEntry(const at::Tensor& probs, const std::shared_ptr<AuxLossGrad>& grad, const at::Tensor& like) {
  auto node = std::make_shared<AuxLossGradBackward>();
  node->grad = grad;
  node->probs_shape = probs.sizes().vec();
  node->set_next_edges(torch::autograd::collect_next_edges(probs));
  at::Tensor zero = at::zeros({}, like.options());
  torch::autograd::set_history(zero, node);
  return zero;
}

std::vector<int64_t> toVector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous().cpu();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

}  // namespace

GroupedExpertsImpl::GroupedExpertsImpl(int64_t dim, int64_t hidden, int64_t num_experts) {
  // Parallelizing swaps parameters (DTensors, FSDP's shards): the public
  // fields follow the registry.
  static const bool fields = [] {
    FieldSetter set = [](torch::nn::Module& m, const std::string& n, const at::Tensor& t) {
      auto& experts = dynamic_cast<GroupedExpertsImpl&>(m);
      if (n == "w1") experts.w1 = t;
      if (n == "w2") experts.w2 = t;
      if (n == "w3") experts.w3 = t;
    };
    register_parameter_fields(typeid(GroupedExpertsImpl), set);
    register_parameter_fields(typeid(dtp::nn::HookedImpl<GroupedExpertsImpl>), set);
    return true;
  }();
  (void)fields;
  w1 = register_parameter("w1", at::empty({num_experts, hidden, dim}));
  w2 = register_parameter("w2", at::empty({num_experts, dim, hidden}));
  w3 = register_parameter("w3", at::empty({num_experts, hidden, dim}));
}

at::Tensor GroupedExpertsImpl::forward(const at::Tensor& x, const std::vector<int64_t>& counts) {
  auto local = [](const at::Tensor& p) { return is_dtensor(p) ? to_local(p) : p; };
  const at::Tensor W1 = local(w1), W2 = local(w2), W3 = local(w3);
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == W1.size(0), "GroupedExperts: ", counts.size(),
              " row counts for ", W1.size(0), " local experts.");
  std::vector<at::Tensor> out;
  int64_t at = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] == 0) continue;
    const at::Tensor rows = x.narrow(0, at, counts[e]);
    const auto i = static_cast<int64_t>(e);
    out.push_back(at::matmul(at::silu(at::matmul(rows, W1[i].t())) * at::matmul(rows, W3[i].t()), W2[i].t()));
    at += counts[e];
  }
  if (out.empty()) {
    // Nothing routed here: an empty result still on x's and the weights'
    // graph, so that backward runs this rank's all-to-alls (and data
    // parallelism's reductions) as every other rank does, and the local
    // experts get (zero) gradients as on one device.
    const at::Tensor none = x.narrow(0, 0, 0);
    return at::matmul(at::silu(at::matmul(none, W1[0].t())) * at::matmul(none, W3[0].t()), W2[0].t());
  }
  return at::cat(out);
}

SharedExpertImpl::SharedExpertImpl(int64_t dim, int64_t hidden) {
  const auto linear = [](int64_t in, int64_t out) {
    return dtp::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
  };
  w1 = register_module("w1", linear(dim, hidden));
  w2 = register_module("w2", linear(hidden, dim));
  w3 = register_module("w3", linear(dim, hidden));
}

at::Tensor SharedExpertImpl::forward(const at::Tensor& x) { return w2(at::silu(w1(x)) * w3(x)); }

MoEImpl::MoEImpl(int64_t dim, const MoEConfig& c) : config(c) {
  TORCH_CHECK(c.num_experts > 0 && c.hidden > 0, "MoE: num_experts=", c.num_experts, " and hidden=", c.hidden,
              " must be positive.");
  TORCH_CHECK(c.top_k >= 1 && c.top_k <= c.num_experts, "MoE: top_k=", c.top_k, " must be in [1, num_experts=",
              c.num_experts, "]. Pick top_k <= num_experts.");
  gate = register_module("gate", dtp::nn::Linear(torch::nn::LinearOptions(dim, c.num_experts).bias(false)));
  experts = register_module("experts", GroupedExperts(dim, c.hidden, c.num_experts));
  TORCH_CHECK(c.shared_hidden >= 0, "MoE: shared_hidden=", c.shared_hidden,
              " is negative. Use 0 (no shared expert) or the shared expert's width.");
  if (c.shared_hidden > 0) {
    shared_expert = register_module("shared_expert", SharedExpert(dim, c.shared_hidden));
    shared_expert_gate =
        register_module("shared_expert_gate", dtp::nn::Linear(torch::nn::LinearOptions(dim, 1).bias(false)));
  }
}

// NOTE: [Expert parallelism] With ep_mesh (apply_expert_parallel), every ep
// rank routes its own tokens (ep borrows from data parallelism, as in
// torchtitan) and holds experts [r E/P, (r+1) E/P) of w1/w2/w3 (Shard(0)):
//   1. the per-expert token counts of every rank: one all_gather [P, E];
//   2. dispatch: this rank's routed rows, sorted by expert (so by owner),
//      go to their owners (all_to_all_single, uneven splits, differentiable);
//   3. each local expert runs on its rows from every rank (regrouped from
//      rank-major to expert-major and back);
//   4. combine: the outputs go back (all_to_all_single, splits swapped) and
//      are summed into each token with its routing weights.
// Backward runs the two all-to-alls in reverse. An expert's gradient then
// sums over every rank's tokens, the router's and the rest of the model's
// over this rank's only: the gradient of the sum of the ranks' losses, which
// data parallelism turns into the mean.
at::Tensor MoEImpl::forward(const at::Tensor& input) {
  // Under TP the input arrives replicated: the experts are too, so every tp
  // rank computes the layer on its (identical) local copy.
  std::optional<DeviceMesh> tp_mesh;
  at::Tensor x = input;
  if (is_dtensor(input)) {
    for (const auto& p : placements(input)) {
      TORCH_CHECK(p.is_replicate(), "MoE: the input must be replicated, got ", dtensor_spec(input).str(),
                  ". Parallelize with apply_tensor_parallel (its plan gathers the MoE's input).");
    }
    tp_mesh = device_mesh(input);
    x = to_local(input);
  }
  input_mesh = tp_mesh;
  const std::optional<DeviceMesh>& cut = experts->tp_mesh;  // ExpertTensorParallel
  TORCH_CHECK(!cut || (tp_mesh && *tp_mesh == *cut), "MoE: the experts are cut over ", cut ? cut->str() : "",
              " (ExpertTensorParallel), so the input must be a replicated DTensor on that mesh, got ",
              tp_mesh ? dtensor_spec(input).str() + " on " + tp_mesh->str() : std::string("a plain tensor"),
              ". Gather the input (llama_tp_plan's \"moe\" entry, or PrepareModuleInput to Replicate).");
  TORCH_CHECK(!cut || !ep_mesh, "MoE: ExpertTensorParallel and expert parallelism on one layer are NYI. Pick one.");
  const at::Tensor G = is_dtensor(gate->weight) ? to_local(gate->weight) : gate->weight;
  const int64_t E = config.num_experts, k = config.top_k, D = x.size(-1);
  const at::Tensor flat = x.reshape({-1, D});
  // Cut experts compute partial sums: the gradient their input sends back is
  // partial over the mesh too (the router's is replicated; autograd adds
  // the two as DTensors).
  const at::Tensor expert_flat = cut ? to_local(input, Placements{Partial()}).reshape({-1, D}) : flat;

  // Routing, as HF's Mixtral and Qwen3-MoE: softmax in float32 or wider,
  // top-k, renormalized, back to the activations' dtype.
  const at::Tensor logits = at::matmul(flat, G.t());
  router_probs = at::softmax(logits, -1, at::promote_types(logits.scalar_type(), at::kFloat));
  auto [weights, chosen] = router_probs.topk(k, -1);
  if (config.norm_topk_prob) weights = weights / weights.sum(-1, /*keepdim=*/true);
  weights = weights.to(x.scalar_type());
  selected = chosen;

  // Rows sorted by expert: row i of `sorted` is token order[i] / k.
  const at::Tensor slots = chosen.flatten();
  const at::Tensor order = std::get<1>(slots.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  const at::Tensor token = order.div(k, "floor");
  const at::Tensor sorted = expert_flat.index_select(0, token);
  const std::vector<int64_t> counts = toVector(at::bincount(slots, /*weights=*/{}, E));

  at::Tensor y;
  if (!ep_mesh) {
    y = experts(sorted, counts);
  } else {
    const ProcessGroup group = ep_mesh->get_group(0);
    const int64_t P = group.size(), me = group.rank(), El = E / P;
    // 1. Everyone's counts: all[r][e] rows of rank r for expert e.
    const at::Tensor mine = at::tensor(counts, at::kLong);
    const std::vector<int64_t> all = toVector(group.all_gather(mine.view({1, E}), 0, std::vector<int64_t>(P, 1)).wait());
    // from(r, e): the rows rank r sends to this rank's local expert e; they
    // arrive rank-major, rank r's for expert e at start[r * El + e].
    auto from = [&](int64_t r, int64_t e) { return all[r * E + me * El + e]; };
    std::vector<int64_t> send(P, 0), recv(P, 0), start(P * El), per_expert(El, 0);
    int64_t at = 0;
    for (int64_t r = 0; r < P; ++r) {
      for (int64_t e = 0; e < El; ++e) {
        send[r] += counts[r * El + e];
        recv[r] += from(r, e);
        per_expert[e] += from(r, e);
        start[r * El + e] = at;
        at += from(r, e);
      }
    }
    // 2. Dispatch.
    const at::Tensor got = ep::all_to_all_single_autograd(sorted, recv, send, group);
    // 3. Rank-major (r, e) blocks -> expert-major (e, r), run, and back.
    std::vector<int64_t> perm;
    perm.reserve(at);
    for (int64_t e = 0; e < El; ++e) {
      for (int64_t r = 0; r < P; ++r) {
        for (int64_t i = 0; i < from(r, e); ++i) perm.push_back(start[r * El + e] + i);
      }
    }
    const at::Tensor index = at::tensor(perm, at::kLong).to(x.device());
    const at::Tensor out = experts(got.index_select(0, index), per_expert);
    const at::Tensor back = at::zeros_like(out).index_copy(0, index, out);
    // 4. Combine.
    y = ep::all_to_all_single_autograd(back, send, recv, group);
  }
  at::Tensor w = weights.flatten().index_select(0, order).unsqueeze(1);
  // Each slot's output is a partial sum over `cut`, so the routing weights'
  // gradient is partial too: summed over the mesh before the router sees it.
  if (cut) w = to_local(from_local(w, *cut, {Replicate()}, /*run_check=*/false), Placements{Partial()});
  at::Tensor result = at::zeros_like(flat).index_add(0, token, y * w).view(x.sizes());
  if (!in_checkpoint_recompute()) {
    aux_grad = std::make_shared<AuxLossGrad>();
    if (keep_routing && detail::forward_for_backward())  // training forwards only, not an evaluation's
      routing.push_back({at::one_hot(chosen, E).sum(0), router_probs.detach().sum(0), chosen.size(0), aux_grad});
  }
  if (at::GradMode::is_enabled() && router_probs.requires_grad())
    result = result + auxLossGradEntry(router_probs, aux_grad, result);
  if (tp_mesh)
    result = from_local(result, *tp_mesh, cut ? Placements{Partial()} : placements(input), /*run_check=*/false);
  if (shared_expert) {
    // On the layer's input as it came (a replicated DTensor under TP, where
    // the plan cuts the shared expert like a dense MLP); cut experts' partial
    // sums are reduced first, as the sum of partial and replicated terms.
    if (cut) result = redistribute(result, *tp_mesh, placements(input));
    result = result + at::sigmoid(shared_expert_gate(input)) * shared_expert(input);
  }
  return result;
}

void distribute_experts(MoEImpl& moe, const DeviceMesh& ep) {
  TORCH_CHECK(ep.ndim() == 1, "distribute_experts: expected a 1-D mesh, got ", ep.str(), ". Slice it: mesh[\"ep\"].");
  TORCH_CHECK(moe.config.num_experts % ep.size() == 0, "distribute_experts: num_experts=", moe.config.num_experts,
              " is not divisible by the ep degree ", ep.size(), ". Use an ep degree that divides the number of "
              "experts.");
  TORCH_CHECK(!moe.ep_mesh, "distribute_experts: the experts are spread already (expert parallelism applied twice).");
  torch::NoGradGuard no_grad;
  for (const char* name : {"w1", "w2", "w3"}) {
    const at::Tensor p = moe.experts->named_parameters(/*recurse=*/false)[name];
    TORCH_CHECK(!is_dtensor(p), "distribute_experts: the experts are DTensors already (", dtensor_spec(p).str(),
                "). NYI: expert parallelism after TP, FSDP or DDP; apply it first.");
    at::Tensor shard = distribute_tensor(p.detach(), ep, {Shard(0)});
    shard.set_requires_grad(p.requires_grad());
    set_parameter(*moe.experts, name, shard);
  }
  moe.ep_mesh = ep;
}

void ExpertTensorParallel::apply(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
                                 std::optional<int> /*src_data_rank*/) const {
  auto* experts = dynamic_cast<GroupedExpertsImpl*>(&module);
  TORCH_CHECK(experts != nullptr, "ExpertTensorParallel: expected the experts of a MoE layer at '", fqn, "', got ",
              module.name(), ". Point the plan entry at them (e.g. \"layers.*.moe.experts\").");
  TORCH_CHECK(mesh.ndim() == 1, "ExpertTensorParallel: expected a 1-D mesh, got ", mesh.str(), ". Slice it: mesh[\"tp\"].");
  torch::NoGradGuard no_grad;
  for (const auto& [name, dim] : {std::pair<const char*, int64_t>{"w1", 1}, {"w2", 2}, {"w3", 1}}) {
    const at::Tensor p = experts->named_parameters(/*recurse=*/false)[name];
    TORCH_CHECK(!is_dtensor(p), "ExpertTensorParallel: '", fqn, ".", name, "' is a DTensor already (",
                dtensor_spec(p).str(), "). Apply it once, before data parallelism, and not with expert parallelism.");
    at::Tensor shard = distribute_tensor(p.detach(), mesh, {Shard(dim)});
    shard.set_requires_grad(p.requires_grad());
    set_parameter(*experts, name, shard);
  }
  experts->tp_mesh = mesh;
  if (auto* host = dynamic_cast<nn::HookHost*>(&module)) host->fqn = fqn;
}

void ExpertParallel::apply(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
                           std::optional<int> /*src_data_rank*/) const {
  auto* moe = dynamic_cast<MoEImpl*>(&module);
  TORCH_CHECK(moe != nullptr, "ExpertParallel: expected a MoE module at '", fqn, "', got ", module.name(),
              ". Point the plan entry at the mixture-of-experts modules (e.g. \"layers.*.moe\").");
  distribute_experts(*moe, mesh);
  // CommDebugMode files the dispatch's collectives under the layer.
  if (auto* host = dynamic_cast<nn::HookHost*>(&module)) host->fqn = fqn;
}

}  // namespace dtp::models
