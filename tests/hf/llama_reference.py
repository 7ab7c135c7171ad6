"""Reference logits of a Hugging Face decoder folder, without transformers.

The forward pass follows transformers' modeling_llama.py (LlamaForCausalLM,
eager attention, no cache) line for line, with what the other families add
to it: Llama 3.1's "llama3" rope_scaling (_compute_llama3_parameters),
attention biases (attention_bias; Qwen 2.5's on q/k/v only), Qwen 3's
q_norm/k_norm over head_dim before rotary, Mistral's sliding window (a key
is visible iff q_idx - sliding_window < kv_idx <= q_idx), and the sparse
MoE blocks of Mixtral and Qwen3-MoE (MixtralSparseMoeBlock,
Qwen3MoeSparseMoeBlock: softmax in float32, top-k, renormalized (Mixtral;
Qwen3-MoE when norm_topk_prob), each expert on its tokens, index_add) with
load_balancing_loss_func over all layers' router logits. It runs twice:

- logits_f64: weights cast to float64 and every step in float64, inv_freq and
  cos/sin included: the exact answer, up to float64 rounding.
- logits_f32: weights cast to float32 and HF's float32 computation as HF does
  it (inv_freq in float32, RMSNorm and softmax in float32).

    python3 tests/hf/llama_reference.py tests/data/hf_tiny \
        --tokens "1,5,9;4,4,8" --out /tmp/ref.safetensors

The output file holds logits_f64 f64[batch,seq,vocab], logits_f32
f32[batch,seq,vocab] and input_ids i64[batch,seq]; with --greedy N also
greedy_f64 i64[batch,N], the argmax continuation of every sequence by
repeated float64 forwards; for MoE folders aux_f64, router_aux_loss_coef
times the load-balancing loss of the float64 forward.
"""

import argparse
import math

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from hf_folder import load_config, load_tensors


def rms_norm(x, weight, eps):
    """LlamaRMSNorm: the statistics in at least float32, then weight * x."""
    input_dtype = x.dtype
    x = x.to(torch.promote_types(input_dtype, torch.float32))
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(input_dtype)


def llama3_inv_freq(inv_freq, scaling):
    """_compute_llama3_parameters: long wavelengths / factor, short ones kept,
    the band between smoothly interpolated."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def head_dim_of(cfg):
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def rotary_cos_sin(cfg, seq, dtype):
    """LlamaRotaryEmbedding: cos, sin of shape [seq, head_dim].

    In float32 this is HF's computation: inv_freq and the angles in float32.
    In float64 every step is float64.
    """
    head_dim = head_dim_of(cfg)
    rope_dtype = torch.promote_types(dtype, torch.float32)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(rope_dtype) / head_dim
    inv_freq = 1.0 / (cfg["rope_theta"] ** exponents)
    scaling = cfg.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise SystemExit(f"llama_reference: rope_type {kind!r} is not implemented here")
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    positions = torch.arange(seq, dtype=torch.int64).to(rope_dtype)
    freqs = positions[:, None] * inv_freq[None, :]  # HF's outer product
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    """Rotate half the hidden dims: [x1, x2] -> [-x2, x1]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n_rep):
    """[b, kv_heads, s, d] -> [b, kv_heads * n_rep, s, d], each head n_rep times."""
    b, kv_heads, s, d = x.shape
    if n_rep == 1:
        return x
    x = x[:, :, None, :, :].expand(b, kv_heads, n_rep, s, d)
    return x.reshape(b, kv_heads * n_rep, s, d)


def attention(cfg, w, p, x, cos, sin):
    """LlamaAttention with eager_attention_forward and a causal mask (and the
    families' biases, q/k norms and sliding window)."""
    b, s, _ = x.shape
    heads = cfg["num_attention_heads"]
    kv_heads = cfg["num_key_value_heads"]
    head_dim = head_dim_of(cfg)

    def proj(name, n):  # q/k/v_proj(x).view(b, s, n, head_dim)
        return F.linear(x, w[p + name + ".weight"], w.get(p + name + ".bias")).view(b, s, n, head_dim)

    q, k, v = proj("q_proj", heads), proj("k_proj", kv_heads), proj("v_proj", kv_heads)
    if p + "q_norm.weight" in w:  # Qwen 3: per head, before rotary
        q = rms_norm(q, w[p + "q_norm.weight"], cfg["rms_norm_eps"])
        k = rms_norm(k, w[p + "k_norm.weight"], cfg["rms_norm_eps"])
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = cos[None, None], sin[None, None]  # unsqueeze_dim=1
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    k = repeat_kv(k, heads // kv_heads)
    v = repeat_kv(v, heads // kv_heads)
    scores = torch.matmul(q, k.transpose(2, 3)) * head_dim**-0.5
    q_idx = torch.arange(s)[:, None]
    kv_idx = torch.arange(s)[None, :]
    hidden = kv_idx > q_idx
    window = cfg.get("sliding_window") if cfg["model_type"] in ("mistral", "mixtral") else None
    if window:
        hidden |= kv_idx <= q_idx - window
    # HF adds finfo(dtype).min instead; both give masked probabilities of
    # exactly 0 and the same unmasked ones (the diagonal is never masked).
    scores = scores.masked_fill(hidden, float("-inf"))
    soft_dtype = torch.promote_types(q.dtype, torch.float32)
    probs = F.softmax(scores, dim=-1, dtype=soft_dtype).to(q.dtype)
    out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, heads * head_dim)
    return F.linear(out, w[p + "o_proj.weight"], w.get(p + "o_proj.bias"))


def sparse_moe(cfg, w, x, router_logits):
    """MixtralSparseMoeBlock / Qwen2MoeSparseMoeBlock / Qwen3MoeSparseMoeBlock.forward on x [b, s, d]."""
    b, s, d = x.shape
    mixtral = cfg["model_type"] == "mixtral"
    p = "block_sparse_moe." if mixtral else "mlp."
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    experts = cfg["num_local_experts"] if mixtral else cfg["num_experts"]
    top_k = cfg["num_experts_per_tok"]
    h = x.view(-1, d)
    logits = F.linear(h, w[p + "gate.weight"])
    router_logits.append(logits)
    routing_weights = F.softmax(logits, dim=1, dtype=torch.promote_types(h.dtype, torch.float32))
    routing_weights, selected = torch.topk(routing_weights, top_k, dim=-1)
    if mixtral or cfg.get("norm_topk_prob"):
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
    routing_weights = routing_weights.to(h.dtype)
    out = torch.zeros_like(h)
    mask = F.one_hot(selected, num_classes=experts).permute(2, 1, 0)
    for e in range(experts):
        idx, top_x = torch.where(mask[e])
        if top_x.numel() == 0:
            continue
        cur = h[top_x]
        q = f"{p}experts.{e}."
        y = F.linear(F.silu(F.linear(cur, w[q + names[0] + ".weight"])) * F.linear(cur, w[q + names[1] + ".weight"]),
                     w[q + names[2] + ".weight"])
        out.index_add_(0, top_x, y * routing_weights[top_x, idx, None])
    if cfg["model_type"] == "qwen2_moe":  # the shared expert, gated by a sigmoid
        q = p + "shared_expert."
        shared = F.linear(F.silu(F.linear(h, w[q + "gate_proj.weight"])) * F.linear(h, w[q + "up_proj.weight"]),
                          w[q + "down_proj.weight"])
        out = out + torch.sigmoid(F.linear(h, w[p + "shared_expert_gate.weight"])) * shared
    return out.view(b, s, d)


def load_balancing_loss(cfg, router_logits):
    """transformers' load_balancing_loss_func (no attention mask), with the
    routed fractions in the logits' dtype (HF's .float() rounds them to
    float32, ~1e-8: an artifact, not the published formula)."""
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    logits = torch.cat(router_logits, dim=0)
    routing_weights = F.softmax(logits, dim=-1)
    _, selected = torch.topk(routing_weights, cfg["num_experts_per_tok"], dim=-1)
    expert_mask = F.one_hot(selected, experts)
    tokens_per_expert = torch.mean(expert_mask.float().to(logits.dtype), dim=0)
    router_prob_per_expert = torch.mean(routing_weights, dim=0)
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * experts


def forward(cfg, weights, input_ids, dtype, router_logits=None):
    """LlamaForCausalLM logits [batch, seq, vocab] with weights cast to dtype."""
    w = {k: t.to(dtype) for k, t in weights.items()}
    eps = cfg["rms_norm_eps"]
    h = F.embedding(input_ids, w["model.embed_tokens.weight"])
    cos, sin = rotary_cos_sin(cfg, input_ids.shape[1], dtype)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms_norm(h, w[p + "input_layernorm.weight"], eps)
        h = h + attention(cfg, w, p + "self_attn.", x, cos, sin)
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        if cfg["model_type"] in ("mixtral", "qwen2_moe", "qwen3_moe"):
            lw = {k[len(p):]: t for k, t in w.items() if k.startswith(p)}
            h = h + sparse_moe(cfg, lw, x, router_logits if router_logits is not None else [])
            continue
        gate = F.linear(x, w[p + "mlp.gate_proj.weight"])
        up = F.linear(x, w[p + "mlp.up_proj.weight"])
        h = h + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
    h = rms_norm(h, w["model.norm.weight"], eps)
    head = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
    return F.linear(h, w[head])


def parse_tokens(text):
    """"1,2,3;4,5,6" -> i64[2,3]; every sequence must have the same length."""
    rows = [[int(t) for t in seq.split(",")] for seq in text.split(";")]
    if len({len(r) for r in rows}) != 1:
        raise SystemExit(f"llama_reference: sequences of lengths "
                         f"{[len(r) for r in rows]}, expected one length")
    return torch.tensor(rows, dtype=torch.int64)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--tokens", "--batch-tokens", dest="tokens", required=True,
                    help="one sequence '3,17,5' or same-length ones '3,17;5,8'")
    ap.add_argument("--out", required=True)
    ap.add_argument("--greedy", type=int, default=0, help="new tokens of a greedy continuation")
    a = ap.parse_args()
    input_ids = parse_tokens(a.tokens)
    cfg = load_config(a.model_dir)
    weights = load_tensors(a.model_dir)
    if input_ids.min() < 0 or input_ids.max() >= cfg["vocab_size"]:
        raise SystemExit(f"llama_reference: token ids in [{input_ids.min()}, "
                         f"{input_ids.max()}], expected [0, {cfg['vocab_size']})")
    with torch.no_grad():
        out = {
            "input_ids": input_ids,
            "logits_f64": forward(cfg, weights, input_ids, torch.float64),
            "logits_f32": forward(cfg, weights, input_ids, torch.float32),
        }
        if cfg["model_type"] in ("mixtral", "qwen2_moe", "qwen3_moe"):
            router_logits = []
            forward(cfg, weights, input_ids, torch.float64, router_logits)
            out["aux_f64"] = load_balancing_loss(cfg, router_logits) * cfg["router_aux_loss_coef"]
        if a.greedy:
            ids = input_ids
            for _ in range(a.greedy):
                last = forward(cfg, weights, ids, torch.float64)[:, -1]
                ids = torch.cat([ids, last.argmax(-1, keepdim=True)], dim=1)
            out["greedy_f64"] = ids[:, input_ids.shape[1]:]
    # One metadata key only: safetensors writes several in random order.
    save_file({k: v.contiguous() for k, v in out.items()}, a.out, {"format": "pt"})


if __name__ == "__main__":
    main()
