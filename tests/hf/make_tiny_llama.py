"""Write a random tiny decoder as a Hugging Face folder of one of the families.

--family picks the transformers config and tensors: llama (LlamaForCausalLM,
with --attention-bias and --rope-llama3 for Llama 3.1's rope_scaling),
mistral (--sliding-window), qwen2 (Qwen 2.5: q/k/v biases), qwen3 (q_norm
and k_norm per head; --head-dim apart from hidden / heads), or the mixtures
of experts mixtral (mistral's attention), qwen2_moe (qwen2's, plus a gated
shared expert of --shared-intermediate) and qwen3_moe (qwen3's), with
--experts, --top-k and --moe-intermediate.

The folder looks like what transformers' save_pretrained writes: config.json
plus model.safetensors, or, with --shards N > 1, model-0000k-of-0000N.safetensors
and model.safetensors.index.json. Tensors keep HF's names and state_dict order;
the sharded files split that order into N contiguous runs of about equal bytes.

Weights are random: every matrix is normal with std 1/sqrt(fan_in) (about HF's
0.02 at hidden 4096; at hidden 32 it keeps attention scores and logits O(1)),
and the RMSNorm weights are 1 + 0.1 * randn so they are not all ones.

    python3 tests/hf/make_tiny_llama.py tests/data/hf_tiny --seed 1 --shards 2
"""

import argparse
import json
import math
import os

import torch
from safetensors.torch import save_file

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

QWEN_MOE = ("qwen2_moe", "qwen3_moe")
MOE = ("mixtral",) + QWEN_MOE


def head_dim_of(a):
    return a.head_dim or a.hidden // a.heads


def qkv_bias(a):
    return a.family in ("qwen2", "qwen2_moe") or a.attention_bias


def o_bias(a):
    return a.family not in ("qwen2", "qwen2_moe") and a.attention_bias


def make_config(a):
    """config.json as the family's to_json_string writes it (sorted keys)."""
    c = {
        "architectures": [ARCHITECTURES[a.family]],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": head_dim_of(a),
        "hidden_act": "silu",
        "hidden_size": a.hidden,
        "initializer_range": 0.02,
        "intermediate_size": a.intermediate,
        "max_position_embeddings": a.max_pos,
        "model_type": a.family,
        "num_attention_heads": a.heads,
        "num_hidden_layers": a.layers,
        "num_key_value_heads": a.kv_heads,
        "rms_norm_eps": a.eps,
        "rope_scaling": None,
        "rope_theta": a.rope_theta,
        "tie_word_embeddings": a.tied,
        "torch_dtype": a.dtype,
        "transformers_version": "4.51.0",
        "use_cache": True,
        "vocab_size": a.vocab,
    }
    if a.family == "llama":
        c.update({"attention_bias": a.attention_bias, "mlp_bias": False, "pretraining_tp": 1})
    if a.family in ("qwen3", "qwen3_moe"):
        c["attention_bias"] = a.attention_bias
    if a.family in ("qwen2", "qwen3") + QWEN_MOE:
        c.update({"max_window_layers": a.layers, "sliding_window": None, "use_sliding_window": False})
    if a.family in ("mistral", "mixtral"):
        c["sliding_window"] = a.sliding_window or None
    if a.family == "mixtral":
        c.update({"num_local_experts": a.experts, "num_experts_per_tok": a.top_k,
                  "intermediate_size": a.moe_intermediate, "router_aux_loss_coef": 0.02,
                  "output_router_logits": False})
    if a.family in QWEN_MOE:
        c.update({"num_experts": a.experts, "num_experts_per_tok": a.top_k,
                  "moe_intermediate_size": a.moe_intermediate, "norm_topk_prob": a.norm_topk_prob,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
                  "output_router_logits": False})
    if a.family == "qwen2_moe":
        c.update({"shared_expert_intermediate_size": a.shared_intermediate, "qkv_bias": True})
    if a.rope_llama3:
        factor, low, high, original = a.rope_llama3.split(",")
        c["rope_scaling"] = {"factor": float(factor), "low_freq_factor": float(low),
                             "high_freq_factor": float(high),
                             "original_max_position_embeddings": int(original),
                             "rope_type": "llama3"}
    return c


def make_weights(a):
    """HF-named random weights in the family's state_dict() order."""
    g = torch.Generator().manual_seed(a.seed)
    head_dim = head_dim_of(a)

    def matrix(rows, cols):
        return torch.randn(rows, cols, generator=g) / math.sqrt(cols)

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    def bias(n):
        return 0.1 * torch.randn(n, generator=g)

    w = {"model.embed_tokens.weight": matrix(a.vocab, a.hidden)}
    for i in range(a.layers):
        p = f"model.layers.{i}."
        for name, rows in (("q", a.heads), ("k", a.kv_heads), ("v", a.kv_heads)):
            w[p + f"self_attn.{name}_proj.weight"] = matrix(rows * head_dim, a.hidden)
            if qkv_bias(a):
                w[p + f"self_attn.{name}_proj.bias"] = bias(rows * head_dim)
        w[p + "self_attn.o_proj.weight"] = matrix(a.hidden, a.heads * head_dim)
        if o_bias(a):
            w[p + "self_attn.o_proj.bias"] = bias(a.hidden)
        if a.family in ("qwen3", "qwen3_moe"):
            w[p + "self_attn.q_norm.weight"] = norm(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(head_dim)
        if a.family in MOE:
            # MixtralSparseMoeBlock (block_sparse_moe: experts.N.w1/w2/w3) or
            # Qwen2Moe/Qwen3MoeSparseMoeBlock (mlp: experts.N.{gate,up,down}_proj),
            # in state_dict order: a router, then each expert's matrices, then
            # Qwen2-MoE's shared expert and its gate.
            mixtral = a.family == "mixtral"
            m = p + ("block_sparse_moe." if mixtral else "mlp.")
            up = (a.moe_intermediate, a.hidden)
            down = (a.hidden, a.moe_intermediate)
            shapes = ([("w1", up), ("w2", down), ("w3", up)] if mixtral else
                      [("gate_proj", up), ("up_proj", up), ("down_proj", down)])
            w[m + "gate.weight"] = matrix(a.experts, a.hidden)
            for e in range(a.experts):
                for name, (rows, cols) in shapes:
                    w[m + f"experts.{e}.{name}.weight"] = matrix(rows, cols)
            if a.family == "qwen2_moe":
                for name, (rows, cols) in (("gate_proj", (a.shared_intermediate, a.hidden)),
                                           ("up_proj", (a.shared_intermediate, a.hidden)),
                                           ("down_proj", (a.hidden, a.shared_intermediate))):
                    w[m + f"shared_expert.{name}.weight"] = matrix(rows, cols)
                w[m + "shared_expert_gate.weight"] = matrix(1, a.hidden)
        else:
            w[p + "mlp.gate_proj.weight"] = matrix(a.intermediate, a.hidden)
            w[p + "mlp.up_proj.weight"] = matrix(a.intermediate, a.hidden)
            w[p + "mlp.down_proj.weight"] = matrix(a.hidden, a.intermediate)
        w[p + "input_layernorm.weight"] = norm(a.hidden)
        w[p + "post_attention_layernorm.weight"] = norm(a.hidden)
    w["model.norm.weight"] = norm(a.hidden)
    if not a.tied:
        w["lm_head.weight"] = matrix(a.vocab, a.hidden)
    dtype = DTYPES[a.dtype]
    return {k: v.to(dtype).contiguous() for k, v in w.items()}


def split_in_order(weights, n):
    """Split the ordered names into n contiguous runs of about equal bytes.

    A tensor goes to the shard that holds the middle of its bytes, e.g.
    byte sizes [4,4,4,4] in 2 shards -> [[0,1],[2,3]].
    """
    total = sum(t.nbytes for t in weights.values())
    shards = [[] for _ in range(n)]
    start = 0
    for name, t in weights.items():
        k = min(n - 1, int((start + t.nbytes / 2) * n // total))
        shards[k].append(name)
        start += t.nbytes
    empty = [k + 1 for k, s in enumerate(shards) if not s]
    if empty:
        raise SystemExit(
            f"make_tiny_llama: empty shard(s) {empty} for --shards {n}: got "
            f"{len(weights)} tensors of {total} bytes. Use fewer shards.")
    return shards, total


def write_json(path, obj):
    """JSON as transformers writes it: indent 2, sorted keys, final newline."""
    with open(path, "w") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=96)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=96)
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--eps", type=float, default=1e-5)
    ap.add_argument("--max-pos", type=int, default=64)
    ap.add_argument("--family", choices=sorted(ARCHITECTURES), default="llama")
    ap.add_argument("--head-dim", type=int, default=0, help="0: hidden / heads")
    ap.add_argument("--attention-bias", action="store_true", help="llama, qwen3: biases on q, k, v and o")
    ap.add_argument("--sliding-window", type=int, default=0, help="mistral; 0: none")
    ap.add_argument("--rope-llama3", default="", metavar="FACTOR,LOW,HIGH,ORIGINAL",
                    help="rope_scaling of rope_type llama3")
    ap.add_argument("--experts", type=int, default=4, help="mixtral, qwen2_moe, qwen3_moe")
    ap.add_argument("--top-k", type=int, default=2, help="mixtral, qwen*_moe: experts per token")
    ap.add_argument("--moe-intermediate", type=int, default=48, help="mixtral, qwen*_moe: each expert's width")
    ap.add_argument("--shared-intermediate", type=int, default=40, help="qwen2_moe: the shared expert's width")
    ap.add_argument("--norm-topk-prob", action="store_true", help="qwen*_moe: renormalize the top-k weights")
    a = ap.parse_args()
    if (not a.head_dim and a.hidden % a.heads) or a.heads % a.kv_heads or head_dim_of(a) % 2:
        ap.error(f"got hidden {a.hidden}, heads {a.heads}, kv-heads "
                 f"{a.kv_heads}, head-dim {a.head_dim}, expected heads | hidden "
                 f"(or --head-dim), kv-heads | heads and an even head_dim")
    if a.attention_bias and a.family not in ("llama", "qwen3", "qwen3_moe"):
        ap.error(f"--attention-bias with --family {a.family}: only llama and qwen3 have it")
    if a.sliding_window and a.family not in ("mistral", "mixtral"):
        ap.error(f"--sliding-window with --family {a.family}: only mistral has it")
    if a.shards < 1:
        ap.error(f"got --shards {a.shards}, expected >= 1")

    os.makedirs(a.out_dir, exist_ok=True)
    for old in os.listdir(a.out_dir):  # a stale shard would join the folder
        if old.startswith("model") and ".safetensors" in old:
            os.remove(os.path.join(a.out_dir, old))
    write_json(os.path.join(a.out_dir, "config.json"), make_config(a))
    weights = make_weights(a)
    meta = {"format": "pt"}
    if a.shards == 1:
        save_file(weights, os.path.join(a.out_dir, "model.safetensors"), meta)
        return
    shards, total = split_in_order(weights, a.shards)
    weight_map = {}
    for k, names in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{a.shards:05d}.safetensors"
        save_file({n: weights[n] for n in names},
                  os.path.join(a.out_dir, fname), meta)
        weight_map.update({n: fname for n in names})
    write_json(os.path.join(a.out_dir, "model.safetensors.index.json"),
               {"metadata": {"total_size": total}, "weight_map": weight_map})


if __name__ == "__main__":
    main()
