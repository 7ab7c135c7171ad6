#!/usr/bin/python3
"""A Hugging Face Llama folder (config.json, *.safetensors) as a GGUF file
for llama.cpp, in F32, F16 or Q8_0, written by dtp's own code: the side-by-side
reference of bench/decode_bench.sh. Debian's python3-numpy; no gguf package.

    /usr/bin/python3 bench/hf_to_gguf.py /tmp/hf1b /tmp/hf1b-q8_0.gguf --type q8_0

What llama.cpp's "llama" architecture expects, and how the HF folder maps:
- File: "GGUF", version 3, tensor and key counts, the key/value pairs, the
  tensor infos (name, dims innermost first, ggml type, offset), then the
  data, each tensor at a multiple of 32 bytes (general.alignment's default).
- Dims: an HF weight [out, in] (row-major) is ggml's ne = [in, out]; the
  bytes are the same.
- Rotary pairs: HF's Llama rotates the halves of each head (rotate_half:
  element i with i + d/2); llama.cpp's "llama" rotates adjacent pairs (2i,
  2i+1). So q_proj's and k_proj's output rows are reordered within each head
  (row j of the first half goes to 2j, of the second half to 2j+1), which
  makes the two the same function; k with the kv heads.
- Types: the 2-D matrices in the chosen type, the norms (1-D) in F32, as
  llama.cpp's own converter does. Q8_0: blocks of 32 along a row, each an
  F16 scale d = max|x| / 127 and 32 int8 round(x / d) (round half away from
  zero, 1/d taken in float32 before d is rounded to F16: ggml's reference
  quantizer).
- Tied embeddings: no output.weight; llama.cpp then reads token_embd.
- Tokenizer: the ids are what matter here (the bench feeds token ids, not
  text), so the vocabulary is a sentencepiece-style ("llama") table of the
  model's size: ids 0-255 the byte tokens <0x00>..<0xFF> (dtp's byte
  tokenizer's ids for the same bytes), the last three <unk>, <s>, </s>, the
  rest placeholder pieces. A folder's real tokenizer is not converted (NYI).
"""

import argparse
import json
import os
import struct
import sys

import numpy as np

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGN = 32
# gguf value types
T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY = 4, 5, 6, 7, 8, 9
# ggml tensor types and llama file types
GGML = {"f32": 0, "f16": 1, "q8_0": 8}
FILE_TYPE = {"f32": 0, "f16": 1, "q8_0": 7}
Q8_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])  # 34 bytes


def gguf_str(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, value):
    out = gguf_str(key) + struct.pack("<I", vtype)
    if vtype == T_UINT32:
        return out + struct.pack("<I", value)
    if vtype == T_FLOAT32:
        return out + struct.pack("<f", value)
    if vtype == T_BOOL:
        return out + struct.pack("<?", value)
    if vtype == T_STRING:
        return out + gguf_str(value)
    raise ValueError(vtype)


def kv_array(key, etype, values):
    out = [gguf_str(key), struct.pack("<IIQ", T_ARRAY, etype, len(values))]
    if etype == T_STRING:
        out += [gguf_str(v) for v in values]
    elif etype == T_FLOAT32:
        out.append(np.asarray(values, "<f4").tobytes())
    elif etype == T_INT32:
        out.append(np.asarray(values, "<i4").tobytes())
    else:
        raise ValueError(etype)
    return b"".join(out)


class SafeTensors:
    """The tensors of a folder's *.safetensors files, memory-mapped."""

    DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}

    def __init__(self, folder):
        self.where = {}
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        if not files:
            sys.exit(f"hf_to_gguf: no *.safetensors in '{folder}'. Pass a Hugging Face model folder.")
        for f in files:
            path = os.path.join(folder, f)
            with open(path, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, info in header.items():
                if name != "__metadata__":
                    self.where[name] = (path, 8 + n, info)

    def get(self, name):
        """float32 array of tensor `name` (a memory map where the file holds float32)."""
        path, base, info = self.where[name]
        if info["dtype"] not in self.DTYPES:
            sys.exit(f"hf_to_gguf: NYI: tensor '{name}' has dtype {info['dtype']}; supported are F32, F16, BF16.")
        begin, end = info["data_offsets"]
        a = np.memmap(path, dtype=self.DTYPES[info["dtype"]], mode="r", offset=base + begin,
                      shape=tuple(info["shape"]))
        if info["dtype"] == "BF16":
            return (a.astype("<u4") << 16).view("<f4")
        return a if info["dtype"] == "F32" else a.astype("<f4")


def rope_pairs(w, n_heads):
    """Rows of q_proj/k_proj [n_heads * d, in] from rotate_half order to adjacent pairs."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def q8_0(x):
    """Rows of float32 x (each a multiple of 32 long) as Q8_0 blocks."""
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1)
    d = (amax / np.float32(127)).astype("<f4")
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    scaled = blocks * inv[:, None]
    q = np.trunc(scaled + np.copysign(np.float32(0.5), scaled)).astype("i1")  # C's roundf
    out = np.empty(blocks.shape[0], Q8_BLOCK)
    out["d"] = d.astype("<f2")
    out["qs"] = q
    return out.tobytes()


def nbytes(shape, kind):
    n = int(np.prod(shape))
    if kind == "f32":
        return 4 * n
    if kind == "f16":
        return 2 * n
    return n // 32 * Q8_BLOCK.itemsize


def plan(cfg, st):
    """(gguf name, hf name, hf shape, rope heads or 0) for every tensor, in file order."""
    out = [("token_embd.weight", "model.embed_tokens.weight", 0)]
    for i in range(cfg["num_hidden_layers"]):
        h, g = f"model.layers.{i}.", f"blk.{i}."
        out += [(g + "attn_norm.weight", h + "input_layernorm.weight", 0),
                (g + "attn_q.weight", h + "self_attn.q_proj.weight", cfg["num_attention_heads"]),
                (g + "attn_k.weight", h + "self_attn.k_proj.weight", cfg["num_key_value_heads"]),
                (g + "attn_v.weight", h + "self_attn.v_proj.weight", 0),
                (g + "attn_output.weight", h + "self_attn.o_proj.weight", 0),
                (g + "ffn_norm.weight", h + "post_attention_layernorm.weight", 0),
                (g + "ffn_gate.weight", h + "mlp.gate_proj.weight", 0),
                (g + "ffn_up.weight", h + "mlp.up_proj.weight", 0),
                (g + "ffn_down.weight", h + "mlp.down_proj.weight", 0)]
    out.append(("output_norm.weight", "model.norm.weight", 0))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("output.weight", "lm_head.weight", 0))
    for _, hf, _ in out:
        if hf not in st.where:
            sys.exit(f"hf_to_gguf: tensor '{hf}' is missing from the folder's safetensors. Pass a Llama folder.")
    return [(g, hf, st.where[hf][2]["shape"], heads) for g, hf, heads in out]


def tokenizer_kvs(vocab):
    if vocab < 259:
        sys.exit(f"hf_to_gguf: vocab_size {vocab}: the byte table needs at least 259 ids (256 bytes, unk, bos, eos).")
    tokens = [f"<0x{b:02X}>" for b in range(256)] + [f"\u2581t{i}" for i in range(256, vocab - 3)]
    tokens += ["<unk>", "<s>", "</s>"]
    types = [6] * 256 + [1] * (vocab - 259) + [2, 3, 3]  # byte, normal, unknown, control
    return [kv("tokenizer.ggml.model", T_STRING, "llama"),
            kv_array("tokenizer.ggml.tokens", T_STRING, tokens),
            kv_array("tokenizer.ggml.scores", T_FLOAT32, [0.0] * vocab),
            kv_array("tokenizer.ggml.token_type", T_INT32, types),
            kv("tokenizer.ggml.unknown_token_id", T_UINT32, vocab - 3),
            kv("tokenizer.ggml.bos_token_id", T_UINT32, vocab - 2),
            kv("tokenizer.ggml.eos_token_id", T_UINT32, vocab - 1),
            kv("tokenizer.ggml.add_bos_token", T_BOOL, False),
            kv("tokenizer.ggml.add_eos_token", T_BOOL, False)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("out")
    ap.add_argument("--type", choices=sorted(GGML), default="f32", help="type of the 2-D matrices")
    a = ap.parse_args()
    with open(os.path.join(a.folder, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("model_type") != "llama":
        sys.exit(f"hf_to_gguf: NYI: model_type '{cfg.get('model_type')}'; only 'llama' is written.")
    if cfg.get("rope_scaling") or cfg.get("rope_parameters"):
        sys.exit("hf_to_gguf: NYI: rope_scaling; only the default rotary embedding is written.")
    st = SafeTensors(a.folder)
    tensors = plan(cfg, st)
    dim, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    meta = [kv("general.architecture", T_STRING, "llama"),
            kv("general.name", T_STRING, os.path.basename(os.path.normpath(a.folder))),
            kv("general.file_type", T_UINT32, FILE_TYPE[a.type]),
            kv("llama.context_length", T_UINT32, cfg.get("max_position_embeddings", 2048)),
            kv("llama.embedding_length", T_UINT32, dim),
            kv("llama.block_count", T_UINT32, cfg["num_hidden_layers"]),
            kv("llama.feed_forward_length", T_UINT32, cfg["intermediate_size"]),
            kv("llama.rope.dimension_count", T_UINT32, dim // heads),
            kv("llama.attention.head_count", T_UINT32, heads),
            kv("llama.attention.head_count_kv", T_UINT32, cfg.get("num_key_value_heads", heads)),
            kv("llama.attention.layer_norm_rms_epsilon", T_FLOAT32, cfg.get("rms_norm_eps", 1e-5)),
            kv("llama.rope.freq_base", T_FLOAT32, cfg.get("rope_theta", 10000.0)),
            kv("llama.vocab_size", T_UINT32, cfg["vocab_size"])] + tokenizer_kvs(cfg["vocab_size"])
    infos, offset, kinds = [], 0, []
    for name, _, shape, _ in tensors:
        kind = a.type if len(shape) == 2 else "f32"
        if kind == "q8_0" and shape[-1] % 32:
            sys.exit(f"hf_to_gguf: Q8_0 needs rows that are a multiple of 32: '{name}' has {shape}. Use --type f16.")
        infos.append(gguf_str(name) + struct.pack("<I", len(shape)) +
                     b"".join(struct.pack("<Q", d) for d in reversed(shape)) +
                     struct.pack("<IQ", GGML[kind], offset))
        kinds.append(kind)
        offset += -(-nbytes(shape, kind) // ALIGN) * ALIGN
    with open(a.out, "wb") as f:
        f.write(GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(meta)))
        f.write(b"".join(meta))
        f.write(b"".join(infos))
        f.write(b"\0" * (-f.tell() % ALIGN))
        for (name, hf, shape, rope_heads), kind in zip(tensors, kinds):
            w = st.get(hf)
            if rope_heads:
                w = rope_pairs(w, rope_heads)
            rows = max(1, (1 << 24) // max(1, int(np.prod(shape[1:]))))  # 64 MB of float32 at a time
            for r in range(0, shape[0], rows):
                part = np.ascontiguousarray(w[r:r + rows], dtype="<f4")
                f.write(part.tobytes() if kind == "f32" else part.astype("<f2").tobytes() if kind == "f16"
                        else q8_0(part))
            f.write(b"\0" * (-f.tell() % ALIGN))
    print(f"{a.out}: {len(tensors)} tensors, {a.type}, {os.path.getsize(a.out) / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
