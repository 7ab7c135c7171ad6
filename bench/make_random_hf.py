"""A random-weight Llama (or Mixtral) Hugging Face folder, float32, with the
standard library only (no torch, no numpy): for memory and speed
measurements at a real model's shape, not for the quality of its text.

Each matrix is a normal(0, 0.02) block of 2^20 floats tiled from a random
start; the norms are 1. The folder holds config.json and model.safetensors.

    python3 bench/make_random_hf.py /tmp/hf2048 --dim 2048 --layers 4 --heads 32 \\
        --kv-heads 8 --ffn 8192 --vocab 32000 --tie        # 1.24 GB
    dtprun -n 2 build/apps/dtp-generate --hf /tmp/hf2048 --prompt "The " --tokens 2 --context 64
"""

import argparse
import array
import json
import os
import random
import struct


def tensors(a):
    hd = a.dim // a.heads
    out = [("model.embed_tokens.weight", [a.vocab, a.dim])]
    for i in range(a.layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", [a.dim, a.dim]),
                (p + "self_attn.k_proj.weight", [a.kv_heads * hd, a.dim]),
                (p + "self_attn.v_proj.weight", [a.kv_heads * hd, a.dim]),
                (p + "self_attn.o_proj.weight", [a.dim, a.dim])]
        if a.experts:
            out.append((p + "block_sparse_moe.gate.weight", [a.experts, a.dim]))
            for e in range(a.experts):
                q = p + f"block_sparse_moe.experts.{e}."
                out += [(q + "w1.weight", [a.ffn, a.dim]), (q + "w2.weight", [a.dim, a.ffn]),
                        (q + "w3.weight", [a.ffn, a.dim])]
        else:
            out += [(p + "mlp.gate_proj.weight", [a.ffn, a.dim]), (p + "mlp.up_proj.weight", [a.ffn, a.dim]),
                    (p + "mlp.down_proj.weight", [a.dim, a.ffn])]
        out += [(p + "input_layernorm.weight", [a.dim]), (p + "post_attention_layernorm.weight", [a.dim])]
    out.append(("model.norm.weight", [a.dim]))
    if not a.tie:
        out.append(("lm_head.weight", [a.vocab, a.dim]))
    return out


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tie", action="store_true", help="tie_word_embeddings (no lm_head.weight)")
    ap.add_argument("--experts", type=int, default=0, help="> 0: Mixtral, this many experts of --ffn in every block")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    names = tensors(a)
    header, offset = {}, 0
    for name, shape in names:
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + 4 * numel(shape)]}
        offset += 4 * numel(shape)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    rng = random.Random(a.seed)
    block = array.array("f", (rng.gauss(0, 0.02) for _ in range(1 << 20))).tobytes()
    with open(os.path.join(a.out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape in names:
            if name.endswith("norm.weight"):
                f.write(array.array("f", [1.0] * numel(shape)).tobytes())
                continue
            left, start = 4 * numel(shape), rng.randrange(0, len(block) // 2, 4)
            while left > 0:
                chunk = block[start:start + left]
                f.write(chunk)
                left -= len(chunk)
                start = 0
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": a.dim,
              "intermediate_size": a.ffn, "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads,
              "num_hidden_layers": a.layers, "vocab_size": a.vocab, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "max_position_embeddings": 2048, "tie_word_embeddings": a.tie, "hidden_act": "silu",
              "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
    if a.experts:
        config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=a.experts,
                      num_experts_per_tok=2, sliding_window=None)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    print(f"{a.out}: {offset / 1e9:.2f} GB of float32 weights")


if __name__ == "__main__":
    main()
