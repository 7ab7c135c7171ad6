// The reference Llama-style decoder. Written for plain tensors; under tensor
// parallelism the attention core sees this rank's heads as plain tensors (the
// Colwise projections return local shards), so head counts come from -1.
#include "dtp/models/llama.h"

#include "comm/compat.h"
#include "models/llama_cp.h"

#include "dtp/dcp/state_dict.h"
#include "dtp/dtensor.h"
#include "dtp/inference/kv_cache.h"
#include "dtp/module_utils.h"
#include "dtp/tp/loss_parallel.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>

#include <cmath>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

namespace dtp::models {

int64_t LlamaConfig::hidden() const {
  if (ffn_hidden > 0) return ffn_hidden;
  const int64_t h = 2 * 4 * dim / 3;
  return (h + 31) / 32 * 32;
}

void LlamaConfig::validate() const {
  // One field per error, by its name (not "dim, n_heads, ... must be positive" for n_layers=-1).
  for (const auto& [name, value, least] : {std::make_tuple("dim", dim, int64_t{1}), std::make_tuple("n_layers", n_layers, int64_t{0}),
                                           std::make_tuple("n_heads", n_heads, int64_t{1}),
                                           std::make_tuple("vocab_size", vocab_size, int64_t{1}),
                                           std::make_tuple("max_seq_len", max_seq_len, int64_t{1}),
                                           std::make_tuple("ffn_hidden", ffn_hidden, int64_t{0})})
    TORCH_CHECK(value >= least, "LlamaConfig: ", name, "=", value, ", expected ", least == 0 ? "0 or more" : "1 or more",
                least == 0 && std::string(name) == "ffn_hidden" ? " (0: the SwiGLU default)" : "", ". Fix ", name, ".");
  TORCH_CHECK(explicit_head_dim > 0 || dim % n_heads == 0, "LlamaConfig: dim=", dim,
              " is not divisible by n_heads=", n_heads, ". Pick dim as a multiple of n_heads, or set explicit_head_dim.");
  TORCH_CHECK(explicit_head_dim >= 0, "LlamaConfig: explicit_head_dim=", explicit_head_dim,
              " is negative. Use 0 (dim / n_heads) or the head size.");
  TORCH_CHECK(head_dim() % 2 == 0, "LlamaConfig: head_dim=", head_dim(), " must be even for rotary embeddings.");
  TORCH_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "LlamaConfig: n_heads=", n_heads,
              " is not a multiple of n_kv_heads=", n_kv_heads, ". Pick n_kv_heads dividing n_heads.");
  TORCH_CHECK(!tie_embeddings || (with_embedding && with_head),
              "LlamaConfig: tie_embeddings needs both the embedding and the head in this module.");
  TORCH_CHECK(dropout >= 0.0 && dropout < 1.0, "LlamaConfig: dropout=", dropout, " must be in [0, 1).");
  TORCH_CHECK(at::isFloatingType(dtype), "LlamaConfig: dtype=", dtype,
              " is not a floating-point type. Use float32, float64, bfloat16 or float16.");
  if (moe.num_experts > 0) {
    TORCH_CHECK(moe.top_k >= 1 && moe.top_k <= moe.num_experts, "LlamaConfig: moe.top_k=", moe.top_k,
                " must be in [1, num_experts=", moe.num_experts, "]. Pick top_k <= num_experts.");
    TORCH_CHECK(moe.hidden > 0, "LlamaConfig: moe.hidden=", moe.hidden, " must be positive (each expert's width).");
  }
  TORCH_CHECK(sliding_window >= 0, "LlamaConfig: sliding_window=", sliding_window,
              " is negative. Use 0 (full attention) or the window length.");
  const RopeScaling& r = rope_scaling;
  TORCH_CHECK(r.factor == 0.0 || (r.factor >= 1.0 && r.low_freq_factor > 0.0 &&
                                  r.high_freq_factor > r.low_freq_factor && r.original_max_position_embeddings > 0),
              "LlamaConfig: rope_scaling {factor=", r.factor, ", low_freq_factor=", r.low_freq_factor,
              ", high_freq_factor=", r.high_freq_factor, ", original_max_position_embeddings=",
              r.original_max_position_embeddings, "} is invalid: expected factor >= 1, 0 < low_freq_factor < "
              "high_freq_factor and a positive original_max_position_embeddings (or factor 0: no scaling).");
}

at::Tensor rope_inv_freq(const LlamaConfig& c) {
  const int64_t hd = c.head_dim();
  at::Tensor inv = at::pow(c.rope_theta, -at::arange(0, hd, 2, at::kDouble) / hd);
  const RopeScaling& r = c.rope_scaling;
  if (r.factor == 0.0) return inv;
  // Llama 3.1's bands by wavelength (HF's _compute_llama3_parameters).
  const double old_len = static_cast<double>(r.original_max_position_embeddings);
  const at::Tensor wavelen = 2.0 * M_PI / inv;
  const at::Tensor low = wavelen > old_len / r.low_freq_factor;    // long waves: stretched
  const at::Tensor high = wavelen < old_len / r.high_freq_factor;  // short waves: kept
  const at::Tensor scaled = at::where(low, inv / r.factor, inv);
  const at::Tensor smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  const at::Tensor between = (1.0 - smooth) * scaled / r.factor + smooth * scaled;
  return at::where(low.logical_or(high), scaled, between);
}

namespace {

// Parameters of `m` and its submodules moved to the meta device (in
// `dtype`), keeping which require grad: deferred_init's construction.
void toMeta(torch::nn::Module& m, c10::ScalarType dtype) {
  m.apply([&](torch::nn::Module& sub) {
    for (const auto& item : sub.named_parameters(/*recurse=*/false)) {
      at::Tensor meta = at::empty(item.value().sizes(), item.value().options().device(at::kMeta).dtype(dtype));
      meta.set_requires_grad(item.value().requires_grad());
      set_parameter(sub, item.key(), meta);
    }
  });
}

// The full value of parameter `name` of a one-device init: normal(0, 0.02)
// from one generator in registration order, output projections of the
// residual branches scaled by 1/sqrt(2 n_layers) (GPT-2), norms 1, biases 0.
at::Tensor initialValue(const std::string& name, c10::IntArrayRef sizes, const LlamaConfig& c, at::Generator& gen) {
  if (name.find("norm") != std::string::npos) return at::ones(sizes);
  if (name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0) return at::zeros(sizes);
  const double std = 0.02, residual_std = 0.02 / std::sqrt(2.0 * std::max<int64_t>(c.n_layers, 1));
  const bool residual = name.find("wo.") != std::string::npos || name.find("w2.") != std::string::npos ||
                        (name.size() > 11 && name.compare(name.size() - 11, 11, ".experts.w2") == 0);
  return at::normal(0.0, residual ? residual_std : std, sizes, gen);
}

// NOTE: [Deferred initialization] With LlamaConfig::deferred_init the model
// is built on the meta device (no memory). Parallelizing it turns each meta
// parameter into this rank's shard, allocated on the mesh's device and not
// initialized: distribute_tensor of a meta tensor sends no values
// (src/dtensor/api.cpp), fully_shard's dp shard likewise
// (src/fsdp/fully_shard.cpp). init_weights then runs this pass, and a forward
// before it is an error. The same pass serves both inits: every
// registered entry, in order, draws its full value; a plain parameter takes
// it, a meta one is replaced by it, a DTensor keeps its shard of it (copy_
// from a replicated value: no communication). A tied parameter's second
// entry draws too (so later draws line up) and keeps the first's value.
// Every parameter is drawn in turn (one device's values); with `only`, just
// those parameters are set and the others (other pipeline stages') stay as
// they are.
void initParameters(torch::nn::Module& model, const LlamaConfig& c,
                    const std::unordered_set<const c10::TensorImpl*>* only = nullptr) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(c.seed);
  torch::NoGradGuard no_grad;
  ImplicitReplicationGuard replicated;
  std::unordered_map<const c10::TensorImpl*, at::Tensor> done;  // parameter -> what it became
  const auto modules = model.named_modules("", /*include_self=*/false);  // in the constructor: no shared_ptr yet
  for (const auto& item : model.named_parameters()) {
    const at::Tensor& p = item.value();
    at::Tensor full = initialValue(item.key(), p.sizes(), c, gen);
    if (only != nullptr && !only->count(p.unsafeGetTensorImpl())) continue;
    const auto dot = item.key().rfind('.');
    torch::nn::Module& owner = dot == std::string::npos ? model : *modules[item.key().substr(0, dot)];
    const std::string name = dot == std::string::npos ? item.key() : item.key().substr(dot + 1);
    auto seen = done.find(p.unsafeGetTensorImpl());
    if (seen != done.end()) {
      if (!seen->second.is_same(p)) set_parameter(owner, name, seen->second);  // a materialized tie
      continue;
    }
    at::Tensor now = p;
    if (p.is_meta()) {
      now = full.to(c.device, p.scalar_type()).requires_grad_(p.requires_grad());
      set_parameter(owner, name, now);
    } else {
      now.copy_(full);
    }
    done.emplace(p.unsafeGetTensorImpl(), now);
  }
}

}  // namespace

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& c, const at::Tensor& s) {
  auto pairs = x.unflatten(-1, {-1, 2});
  auto x0 = pairs.select(-1, 0), x1 = pairs.select(-1, 1);
  // In the tables' dtype, then back: under mixed precision x is bf16.
  return at::stack({x0 * c - x1 * s, x0 * s + x1 * c}, -1).flatten(-2).to(x.scalar_type());
}

AttentionImpl::AttentionImpl(const LlamaConfig& c)
    : head_dim(c.head_dim()), sliding_window(c.sliding_window) {
  auto linear = [&](int64_t in, int64_t out, bool bias) {
    return dtp::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
  };
  wq = register_module("wq", linear(c.dim, c.n_heads * head_dim, c.qkv_bias));
  wk = register_module("wk", linear(c.dim, c.n_kv_heads * head_dim, c.qkv_bias));
  wv = register_module("wv", linear(c.dim, c.n_kv_heads * head_dim, c.qkv_bias));
  wo = register_module("wo", linear(c.n_heads * head_dim, c.dim, c.o_bias));
  if (c.qk_norm) {
    q_norm = register_module("q_norm", dtp::nn::RMSNorm(head_dim, c.norm_eps));
    k_norm = register_module("k_norm", dtp::nn::RMSNorm(head_dim, c.norm_eps));
  }
  const auto angles = at::outer(at::arange(c.max_seq_len, at::kDouble), rope_inv_freq(c));
  rope_cos = register_buffer("rope_cos", angles.cos().to(c.device, c.dtype));
  rope_sin = register_buffer("rope_sin", angles.sin().to(c.device, c.dtype));
}

at::Tensor causal_attention(at::Tensor q, at::Tensor k, at::Tensor v, const at::Tensor& rope_cos,
                            const at::Tensor& rope_sin, int64_t window) {
  const int64_t batch = q.size(0), seq = q.size(1), head_dim = q.size(3), n_rep = q.size(2) / k.size(2);
  TORCH_CHECK(seq <= rope_cos.size(0), "Attention: sequence length ", seq, " exceeds max_seq_len=",
              rope_cos.size(0), ". Raise LlamaConfig::max_seq_len.");
  const auto c = rope_cos.narrow(0, 0, seq).view({1, seq, 1, -1}), s = rope_sin.narrow(0, 0, seq).view({1, seq, 1, -1});
  q = apply_rope(q, c, s);
  k = apply_rope(k, c, s);
  if (n_rep > 1) {
    const int64_t kv = k.size(2);
    k = k.unsqueeze(3).expand({batch, seq, kv, n_rep, head_dim}).reshape({batch, seq, kv * n_rep, head_dim});
    v = v.unsqueeze(3).expand({batch, seq, kv, n_rep, head_dim}).reshape({batch, seq, kv * n_rep, head_dim});
  }
  q = q.transpose(1, 2);
  k = k.transpose(1, 2);
  v = v.transpose(1, 2);
  const bool windowed = window > 0 && window < seq;
#if DTP_HAS_SDPA
  // libtorch picks its fused kernel (flash on CPU) where the inputs allow.
  if (!windowed) {
    at::Tensor out = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
    return out.transpose(1, 2).reshape({batch, seq, -1});
  }
#endif
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim));
  at::Tensor hidden = at::ones({seq, seq}, q.options().dtype(at::kBool)).triu(1);  // the future, on q's device
  if (windowed) hidden = hidden.logical_or(at::ones({seq, seq}, hidden.options()).tril(-window));  // the distant past
  scores = scores.masked_fill(hidden, -std::numeric_limits<float>::infinity());
  at::Tensor out = at::matmul(at::softmax(scores, -1), v);
  return out.transpose(1, 2).reshape({batch, seq, -1});
}

at::Tensor AttentionImpl::forward(const at::Tensor& x) {
  const int64_t batch = x.size(0), seq = x.size(1);
  // Under TP these are this rank's heads, plain tensors. One statement each:
  // the order of q, k, v fixes the order their gradients are summed in.
  at::Tensor q = wq(x).view({batch, seq, -1, head_dim});
  at::Tensor k = wk(x), v = wv(x);
  if (kv_head >= 0) {
    // Replicated projections: this rank's one KV head, whose gradient is
    // this rank's part of the sum over the ranks sharing it (Partial).
    k = to_local(k, Placements{Partial()}).view({batch, seq, -1, head_dim}).narrow(2, kv_head, 1);
    v = to_local(v, Placements{Partial()}).view({batch, seq, -1, head_dim}).narrow(2, kv_head, 1);
  } else {
    k = k.view({batch, seq, -1, head_dim});
    v = v.view({batch, seq, -1, head_dim});
  }
  if (q_norm) {
    q = q_norm(q);
    k = k_norm(k);
  }
  if (KVCache* cache = KVCache::active()) {
    TORCH_CHECK(!context_parallel, "NYI: the KV cache under context parallelism (#58): layer ", layer_index,
                " has a cp group, and a KV-cache forward (model->forward(tokens, cache, valid)) runs "
                "without it. Use models::generate or the inference Engine (models::engine_model), which prefill a "
                "fresh prompt over cp and decode without it (NOTE: [Context-parallel prefill]).");
    return wo(cached_attention(q, k, v, rope_cos, rope_sin, *cache, layer_index, sliding_window));
  }
  if (context_parallel) return wo(detail::context_parallel_attention(*this, q, k, v));
  return wo(causal_attention(q, k, v, rope_cos, rope_sin, sliding_window));
}

FeedForwardImpl::FeedForwardImpl(const LlamaConfig& c) {
  auto linear = [&](int64_t in, int64_t out) {
    return dtp::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
  };
  w1 = register_module("w1", linear(c.dim, c.hidden()));
  w2 = register_module("w2", linear(c.hidden(), c.dim));
  w3 = register_module("w3", linear(c.dim, c.hidden()));
}

at::Tensor FeedForwardImpl::forward(const at::Tensor& x) { return w2(at::silu(w1(x)) * w3(x)); }

TransformerBlockImpl::TransformerBlockImpl(const LlamaConfig& c) {
  attention_norm = register_module("attention_norm", dtp::nn::RMSNorm(c.dim, c.norm_eps));
  attention = register_module("attention", Attention(c));
  ffn_norm = register_module("ffn_norm", dtp::nn::RMSNorm(c.dim, c.norm_eps));
  if (c.moe.num_experts > 0) {
    moe = register_module("moe", MoE(c.dim, c.moe));
  } else {
    feed_forward = register_module("feed_forward", FeedForward(c));
  }
  dropout = register_module("dropout", dtp::nn::Dropout(c.dropout));
}

at::Tensor TransformerBlockImpl::forward(const at::Tensor& x) {
  at::Tensor h = x + dropout(attention(attention_norm(x)));
  return h + dropout(moe ? moe(ffn_norm(h)) : feed_forward(ffn_norm(h)));
}

LlamaImpl::LlamaImpl(LlamaConfig c) : config(std::move(c)) {
  config.validate();
  // Deferred: each block goes to the meta device as soon as it is built, so
  // construction holds at most one block's memory. The embedding and the
  // head, a vocabulary's rows each (1.05 GB apiece in float32 at
  // Llama-3.2-1B's shape), are made on meta directly: built whole first,
  // they were allocated and initialized in full, the construction's peak
  // (dtp-generate --quantize int8 at TP=2 on that shape peaked at 1.73 GB
  // per rank, 1.69 of them before the load, to keep 1.35).
  auto meta = [&](int64_t rows, int64_t cols) {
    return at::empty({rows, cols}, at::TensorOptions().device(at::kMeta).dtype(config.dtype));
  };
  if (config.with_embedding) {
    torch::nn::EmbeddingOptions options(config.vocab_size, config.dim);
    if (config.deferred_init) options._weight(meta(config.vocab_size, config.dim));
    tok_embeddings = register_module("tok_embeddings", dtp::nn::Embedding(options));
  }
  auto settle = [&](torch::nn::Module& m) {
    if (config.deferred_init) toMeta(m, config.dtype);
  };
  if (config.with_embedding) settle(*tok_embeddings);
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.n_layers; ++i) {
    layers->push_back(TransformerBlock(config));
    layers[i]->as<dtp::nn::HookedImpl<TransformerBlockImpl>>()->attention->layer_index = i;
    settle(*layers[i]);
  }
  if (config.with_head) {
    norm = register_module("norm", dtp::nn::RMSNorm(config.dim, config.norm_eps));
    // Deferred: a Linear of no rows, given its shape on meta (above).
    output = register_module("output", dtp::nn::Linear(torch::nn::LinearOptions(
                                           config.dim, config.deferred_init ? 0 : config.vocab_size).bias(false)));
    if (config.deferred_init) {
      output->options.out_features(config.vocab_size);
      at::Tensor weight = meta(config.vocab_size, config.dim);
      weight.set_requires_grad(true);  // a Linear's, as built whole
      set_parameter(*output, "weight", weight);
    }
    settle(*norm);
    settle(*output);
  }
  if (config.deferred_init) {
    awaiting_init = true;
  } else {
    for (auto& p : parameters()) p.set_data(p.data().to(config.device, config.dtype));
    initParameters(*this, config);
  }
  if (config.tie_embeddings) set_parameter(*output, "weight", tok_embeddings->weight);
}

void init_weights(Llama& model, const std::vector<at::Tensor>& only) {
  // Loaded weights are never overwritten: load_hf_weights clears
  // awaiting_init, and a second init is refused like a first init of an
  // eager model.
  TORCH_CHECK(model->awaiting_init, "init_weights: the model holds its weights already: got a model built without "
              "LlamaConfig::deferred_init, or one that load_hf_weights or an earlier init_weights filled; expected a "
              "deferred_init model that nothing has initialized. Drop this call: init_weights would overwrite those "
              "weights with random ones.");
  std::unordered_set<const c10::TensorImpl*> subset;
  for (const auto& p : only) subset.insert(p.unsafeGetTensorImpl());
  initParameters(*model, model->config, only.empty() ? nullptr : &subset);
  model->awaiting_init = false;
  for (const auto& p : model->parameters())
    TORCH_INTERNAL_ASSERT((!subset.empty() && !subset.count(p.unsafeGetTensorImpl())) ||
                              (!p.is_meta() && !(is_dtensor(p) && to_local(p.detach()).is_meta())),
                          "init_weights left a meta parameter");
}

at::Tensor LlamaImpl::forward(const at::Tensor& input) {
  TORCH_CHECK(!awaiting_init, "Llama: built with deferred_init, and neither init_weights(model) nor load_hf_weights "
              "has set its weights. Call init_weights after parallelizing (apply_tensor_parallel, apply_ac, "
              "apply_fsdp/apply_ddp), before the first forward, and before any dcp::load_state: an init after a load "
              "would overwrite the loaded weights.");
  at::Tensor h = config.with_embedding ? tok_embeddings(input) : input;
  for (const auto& layer : *layers) h = dtp::nn::run_hooked(*layer->as<dtp::nn::HookedImpl<TransformerBlockImpl>>(), h);
  if (!config.with_head) return h;
  return output(norm(h));
}

std::vector<std::pair<std::string, at::Tensor>> LlamaImpl::unique_named_parameters() const {
  return dtp::unique_named_parameters(*this);
}

std::vector<at::Tensor> LlamaImpl::unique_parameters() const {
  std::vector<at::Tensor> out;
  for (auto& p : unique_named_parameters()) out.push_back(p.second);
  return out;
}

dcp::StateDictOptions llama_state_dict_options() {
  dcp::StateDictOptions o;
  o.non_persistent_buffers = {"rope_cos", "rope_sin"};
  return o;
}

at::Tensor llama_loss(const at::Tensor& logits, const at::Tensor& targets) {
  // Half-precision logits (mixed precision's compute copies) in float32, as
  // torchtitan's loss: a float16 loss would overflow under a loss scale
  // (4 x 2^16 > 65504), and a bf16 one keeps 3 digits.
  const bool low = logits.scalar_type() == at::kHalf || logits.scalar_type() == at::kBFloat16;
  const at::Tensor flat = (low ? logits.to(at::kFloat) : logits).flatten(0, 1), t = targets.flatten();
  if (is_dtensor(logits)) return loss_parallel_cross_entropy(flat, t);
  return torch::nn::functional::cross_entropy(flat, t);
}

}  // namespace dtp::models
