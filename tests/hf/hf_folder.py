"""Read the weights of a Hugging Face model folder, sharded or not.

A folder holds either model.safetensors, or model.safetensors.index.json
whose weight_map names, for every tensor, the shard file that holds it.
"""

import json
import os

from safetensors import safe_open

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def read_index(model_dir):
    """Return (safetensors files, parsed index or None) of a model folder."""
    path = os.path.join(model_dir, INDEX)
    if os.path.exists(path):
        with open(path) as f:
            index = json.load(f)
        return sorted(set(index["weight_map"].values())), index
    if os.path.exists(os.path.join(model_dir, SINGLE)):
        return [SINGLE], None
    raise SystemExit(f"hf_folder: no {SINGLE} or {INDEX} in '{model_dir}'")


def tensors_by_file(model_dir):
    """Return {file: {name: tensor}} for every safetensors file of the folder."""
    files, _ = read_index(model_dir)
    out = {}
    for fname in files:
        with safe_open(os.path.join(model_dir, fname), framework="pt") as f:
            out[fname] = {k: f.get_tensor(k) for k in f.keys()}
    return out


def load_tensors(model_dir):
    """Return {name: tensor} over all files; a name in two files is an error."""
    merged = {}
    for fname, tensors in tensors_by_file(model_dir).items():
        for name, t in tensors.items():
            if name in merged:
                raise SystemExit(f"hf_folder: tensor '{name}' appears twice in "
                                 f"'{model_dir}' (again in {fname})")
            merged[name] = t
    return merged


def load_config(model_dir):
    """Return the parsed config.json of the folder."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)
