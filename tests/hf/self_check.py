"""Check llama_reference.py against a second, Meta-style Llama forward.

The second forward undoes HF's q/k row permutation and applies rotary to
interleaved pairs as complex numbers (Meta's llama/model.py), with its own
RMSNorm, GQA and causal attention. Both run in float64 and must agree to
1e-12; logits_f32 must stay within 1e-4 of logits_f64.

    python3 tests/hf/self_check.py tests/data/hf_tiny --tokens "1,5,9;4,4,8"
    python3 tests/hf/self_check.py tests/data/hf_tiny \
        --reference tests/data/hf_tiny/reference_logits.safetensors
"""

import argparse
import sys

import torch
from safetensors.torch import load_file

from hf_folder import load_config, load_tensors
from llama_reference import forward, parse_tokens


def hf_to_meta(w, heads):
    """Inverse of HF's convert_llama_weights_to_hf permute of wq / wk rows."""
    dim = w.shape[1]
    head_dim = w.shape[0] // heads
    return w.view(heads, 2, head_dim // 2, dim).transpose(1, 2).reshape(heads * head_dim, dim)


def meta_forward(cfg, weights, tokens):
    """Meta-style float64 Llama: interleaved complex rotary on Meta-order rows."""
    w = {k: t.double() for k, t in weights.items()}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg["hidden_size"] // heads
    eps = cfg["rms_norm_eps"]
    b, s = tokens.shape

    def norm(x, g):
        return g * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    freqs = 1.0 / cfg["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(s, dtype=torch.float64), freqs)
    freqs_cis = torch.polar(torch.ones_like(angles), angles)  # [s, head_dim/2]

    def rope(x):  # x: [b, s, h, head_dim], pairs (2i, 2i+1) rotate together
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)

    h = w["model.embed_tokens.weight"][tokens]
    mask = torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = norm(h, w[p + "input_layernorm.weight"])
        wq = hf_to_meta(w[p + "self_attn.q_proj.weight"], heads)
        wk = hf_to_meta(w[p + "self_attn.k_proj.weight"], kv_heads)
        q = rope((x @ wq.T).view(b, s, heads, head_dim))
        k = rope((x @ wk.T).view(b, s, kv_heads, head_dim))
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(b, s, kv_heads, head_dim)
        k = torch.repeat_interleave(k, heads // kv_heads, dim=2)
        v = torch.repeat_interleave(v, heads // kv_heads, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / head_dim**0.5 + mask
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, -1)
        h = h + out @ w[p + "self_attn.o_proj.weight"].T
        x = norm(h, w[p + "post_attention_layernorm.weight"])
        gate = x @ w[p + "mlp.gate_proj.weight"].T
        up = x @ w[p + "mlp.up_proj.weight"].T
        h = h + (gate * torch.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    h = norm(h, w["model.norm.weight"])
    tied = cfg.get("tie_word_embeddings")
    head = w["model.embed_tokens.weight" if tied else "lm_head.weight"]
    return h @ head.T


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="'3,17,5' or '3,17;5,8': run llama_reference too")
    src.add_argument("--reference", help="a file written by llama_reference.py")
    a = ap.parse_args()
    cfg, weights = load_config(a.model_dir), load_tensors(a.model_dir)
    if a.reference:
        ref = load_file(a.reference)
        tokens = ref["input_ids"]
    else:
        tokens = parse_tokens(a.tokens)
        with torch.no_grad():
            ref = {"logits_f64": forward(cfg, weights, tokens, torch.float64),
                   "logits_f32": forward(cfg, weights, tokens, torch.float32)}
    with torch.no_grad():
        meta = meta_forward(cfg, weights, tokens)
    f64 = ref["logits_f64"]
    d_meta = (f64 - meta).abs().max().item()
    d_f32 = (f64 - ref["logits_f32"].double()).abs().max().item()
    print(f"{a.model_dir}: logits {list(f64.shape)}, max |logits| "
          f"{f64.abs().max().item():.3g}")
    print(f"  max |hf_f64 - meta_f64| = {d_meta:.3g} (bound 1e-12)")
    print(f"  max |hf_f32 - hf_f64|   = {d_f32:.3g} (bound 1e-4)")
    if d_meta > 1e-12 or d_f32 > 1e-4:
        print("self_check: FAILED")
        sys.exit(1)


if __name__ == "__main__":
    main()
