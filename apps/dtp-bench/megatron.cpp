#include "megatron.h"

#include "dtp/nn/modules.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

namespace dtp::bench {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

ProcessGroup group() { return default_process_group(); }
std::vector<int64_t> evenSizes(int64_t local) { return std::vector<int64_t>(group().size(), local); }

// Megatron's f: identity forward, all-reduce backward.
struct CopyToParallel : torch::autograd::Function<CopyToParallel> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x) { return x.view_as(x); }
  static variable_list backward(AutogradContext*, variable_list g) {
    group().all_reduce(g[0]);
    return g;
  }
};

// Megatron's g: all-reduce forward, identity backward.
struct ReduceFromParallel : torch::autograd::Function<ReduceFromParallel> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x) {
    ctx->mark_dirty({x});
    group().all_reduce(x);
    return x;
  }
  static variable_list backward(AutogradContext*, variable_list g) { return g; }
};

// Sequence parallelism: all-gather along the sequence (dim 1) forward,
// reduce-scatter backward, and the reverse.
struct GatherSequence : torch::autograd::Function<GatherSequence> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x) {
    return group().all_gather(x, 1, evenSizes(x.size(1))).wait();
  }
  static variable_list backward(AutogradContext*, variable_list g) {
    const int64_t local = g[0].size(1) / group().size();
    return {group().reduce_scatter(g[0], 1, evenSizes(local)).wait()};
  }
};

struct ScatterSequence : torch::autograd::Function<ScatterSequence> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x) {
    return group().reduce_scatter(x, 1, evenSizes(x.size(1) / group().size())).wait();
  }
  static variable_list backward(AutogradContext*, variable_list g) {
    return {group().all_gather(g[0], 1, evenSizes(g[0].size(1))).wait()};
  }
};

// Vocab-parallel cross-entropy (Megatron's): logits [n, v/tp], targets [n].
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            int64_t vocab_start) {
    at::Tensor max = std::get<0>(logits.max(-1));
    group().all_reduce(max, ReduceOp::Max);
    at::Tensor exp = (logits - max.unsqueeze(1)).exp_();
    at::Tensor sum = exp.sum(-1);
    group().all_reduce(sum);
    const int64_t local_vocab = logits.size(1);
    at::Tensor outside = (targets < vocab_start) | (targets >= vocab_start + local_vocab);
    at::Tensor idx = (targets - vocab_start).masked_fill_(outside, 0).unsqueeze(1);
    at::Tensor target_logit = logits.gather(1, idx).squeeze(1).sub_(max).masked_fill_(outside, 0.0);
    group().all_reduce(target_logit);
    exp.div_(sum.unsqueeze(1));  // softmax, kept for backward
    ctx->save_for_backward({exp, idx, outside});
    return (sum.log() - target_logit).mean();
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0].clone();
    grad.scatter_add_(1, saved[1], (~saved[2]).to(grad.scalar_type()).neg_().unsqueeze(1));
    grad.mul_(g[0] / grad.size(0));
    return {grad, at::Tensor(), at::Tensor()};
  }
};

// This rank's torch.chunk of `full` along `dim`, as a new leaf with its own storage.
at::Tensor slice(const at::Tensor& full, int64_t dim, const ProcessGroup& g) {
  return full.detach().chunk(g.size(), dim)[g.rank()].clone(at::MemoryFormat::Contiguous).requires_grad_();
}

}  // namespace

MegatronLlama::MegatronLlama(const models::Llama& full, const ProcessGroup& g, bool sequence_parallel)
    : group_(g), sp_(sequence_parallel), config_(full->config) {
  TORCH_CHECK(config_.with_embedding && config_.with_head && !config_.tie_embeddings && config_.dropout == 0.0,
              "MegatronLlama: NYI: pipeline stages, tied embeddings and dropout in the hand-written baseline.");
  auto whole = [](const at::Tensor& t) { return t.detach().clone().requires_grad_(); };
  embedding_ = slice(full->tok_embeddings->weight, 0, g);
  vocab_start_ = (config_.vocab_size + g.size() - 1) / g.size() * g.rank();
  for (const auto& m : *full->layers) {
    const auto* b = m->as<models::TransformerBlockImpl>();
    layers_.push_back({whole(b->attention_norm->weight), slice(b->attention->wq->weight, 0, g),
                       slice(b->attention->wk->weight, 0, g), slice(b->attention->wv->weight, 0, g),
                       slice(b->attention->wo->weight, 1, g), whole(b->ffn_norm->weight),
                       slice(b->feed_forward->w1->weight, 0, g), slice(b->feed_forward->w2->weight, 1, g),
                       slice(b->feed_forward->w3->weight, 0, g)});
    rope_cos_ = b->attention->rope_cos;
    rope_sin_ = b->attention->rope_sin;
  }
  norm_ = whole(full->norm->weight);
  output_ = slice(full->output->weight, 0, g);
}

at::Tensor MegatronLlama::enterParallel(const at::Tensor& x) {
  return sp_ ? GatherSequence::apply(x) : CopyToParallel::apply(x);
}

at::Tensor MegatronLlama::leaveParallel(const at::Tensor& x) {
  return sp_ ? ScatterSequence::apply(x) : ReduceFromParallel::apply(x);
}

at::Tensor MegatronLlama::loss(const at::Tensor& tokens, const at::Tensor& targets) {
  const int64_t batch = tokens.size(0), seq = tokens.size(1), head_dim = config_.head_dim();
  const double eps = config_.norm_eps;
  // Vocab-parallel embedding: rows this rank lacks contribute zeros.
  at::Tensor outside = (tokens < vocab_start_) | (tokens >= vocab_start_ + embedding_.size(0));
  at::Tensor h = at::embedding(embedding_, (tokens - vocab_start_).masked_fill_(outside, 0))
                     .masked_fill(outside.unsqueeze(-1), 0.0);
  h = leaveParallel(h);
  for (const Layer& l : layers_) {
    at::Tensor x = enterParallel(nn::rms_norm(h, l.attention_norm, eps));
    auto heads = [&](const at::Tensor& w) { return at::linear(x, w).view({batch, seq, -1, head_dim}); };
    at::Tensor q = heads(l.wq), k = heads(l.wk), v = heads(l.wv);  // in this order, as the model
    at::Tensor a = models::causal_attention(q, k, v, rope_cos_, rope_sin_);
    h = h + leaveParallel(at::linear(a, l.wo));
    at::Tensor f = enterParallel(nn::rms_norm(h, l.ffn_norm, eps));
    h = h + leaveParallel(at::linear(at::silu(at::linear(f, l.w1)) * at::linear(f, l.w3), l.w2));
  }
  at::Tensor logits = at::linear(enterParallel(nn::rms_norm(h, norm_, eps)), output_);
  return VocabParallelCrossEntropy::apply(logits.flatten(0, 1), targets.flatten(), vocab_start_);
}

void MegatronLlama::reduce_norm_grads() {
  if (!sp_) return;
  std::vector<at::Tensor> grads;
  for (const Layer& l : layers_) {
    grads.push_back(l.attention_norm.grad());
    grads.push_back(l.ffn_norm.grad());
  }
  grads.push_back(norm_.grad());
  at::Tensor flat = at::cat(grads);
  group_.all_reduce(flat);
  int64_t offset = 0;
  for (auto& g : grads) {
    g.copy_(flat.narrow(0, offset, g.numel()));
    offset += g.numel();
  }
}

std::vector<at::Tensor> MegatronLlama::parameters() const {
  std::vector<at::Tensor> out{embedding_};
  for (const Layer& l : layers_)
    out.insert(out.end(), {l.attention_norm, l.wq, l.wk, l.wv, l.wo, l.ffn_norm, l.w1, l.w2, l.w3});
  out.insert(out.end(), {norm_, output_});
  return out;
}

}  // namespace dtp::bench
