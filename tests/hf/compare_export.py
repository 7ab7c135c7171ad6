"""Check that an exported Hugging Face Llama folder equals the original.

Compares every tensor of the two folders (sharded or not) by name, dtype,
shape and bytes, the config.json fields that define the model, and, in each
folder with an index, that weight_map names exactly the tensors of its files
and total_size is their byte count.

    python3 tests/hf/compare_export.py tests/data/hf_tiny /tmp/exported

Prints "export matches: N tensors bit for bit" and exits 0, or prints each
difference and exits 1.
"""

import argparse
import os
import sys

import torch

from hf_folder import load_config, read_index, tensors_by_file

CONFIG_FIELDS = [
    "architectures", "model_type", "hidden_size", "intermediate_size",
    "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
    "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "vocab_size",
    "tie_word_embeddings", "attention_bias", "sliding_window",
    "use_sliding_window",
]


def index_problems(model_dir, by_file):
    """Differences between a folder's index and the tensors its files hold."""
    _, index = read_index(model_dir)
    if index is None:
        return []
    weight_map = index["weight_map"]
    problems = []
    held = {n: f for f, ts in by_file.items() for n in ts}
    for name in sorted(set(weight_map) - set(held)):
        problems.append(f"{model_dir}: index names '{name}', no file holds it")
    for name in sorted(set(held) - set(weight_map)):
        problems.append(f"{model_dir}: '{name}' in {held[name]} is missing from the index")
    for name in sorted(set(held) & set(weight_map)):
        if held[name] != weight_map[name]:
            problems.append(f"{model_dir}: index puts '{name}' in "
                            f"{weight_map[name]}, it is in {held[name]}")
    for fname in sorted(os.listdir(model_dir)):
        if fname.startswith("model-") and fname.endswith(".safetensors") \
                and fname not in by_file:
            problems.append(f"{model_dir}: {fname} is not named by the index")
    total = index.get("metadata", {}).get("total_size")
    nbytes = sum(t.nbytes for ts in by_file.values() for t in ts.values())
    if total != nbytes:
        problems.append(f"{model_dir}: index total_size {total}, expected "
                        f"{nbytes} (bytes of all tensors)")
    return problems


def flat(by_file, model_dir, problems):
    """{name: tensor} over the files; a name held twice is a problem."""
    out = {}
    for fname, tensors in by_file.items():
        for name, t in tensors.items():
            if name in out:
                problems.append(f"{model_dir}: '{name}' is held twice (again in {fname})")
            out[name] = t
    return out


def same_bits(a, b):
    """True when two tensors of one dtype and shape hold the same bytes."""
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


def compare(orig_dir, exported_dir):
    """(ok, "export matches: N tensors bit for bit" or each difference on a line)."""
    problems = []
    orig_cfg, exp_cfg = load_config(orig_dir), load_config(exported_dir)
    for key in CONFIG_FIELDS:
        if orig_cfg.get(key) != exp_cfg.get(key):
            problems.append(f"config.json {key}: exported {exp_cfg.get(key)!r}, "
                            f"expected {orig_cfg.get(key)!r}")

    orig_files = tensors_by_file(orig_dir)
    exp_files = tensors_by_file(exported_dir)
    problems += index_problems(orig_dir, orig_files)
    problems += index_problems(exported_dir, exp_files)
    orig = flat(orig_files, orig_dir, problems)
    exp = flat(exp_files, exported_dir, problems)

    for name in sorted(set(orig) - set(exp)):
        problems.append(f"'{name}': missing from the export")
    for name in sorted(set(exp) - set(orig)):
        problems.append(f"'{name}': exported, not in the original")
    for name in sorted(set(orig) & set(exp)):
        o, e = orig[name], exp[name]
        if o.dtype != e.dtype or o.shape != e.shape:
            problems.append(f"'{name}': exported {e.dtype}{list(e.shape)}, "
                            f"expected {o.dtype}{list(o.shape)}")
        elif not same_bits(o, e):
            diff = (o.double() - e.double()).abs().max().item()
            problems.append(f"'{name}': values differ (max abs diff {diff:.3g})")

    if problems:
        return False, "\n".join(problems)
    return True, f"export matches: {len(orig)} tensors bit for bit"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("orig_dir")
    ap.add_argument("exported_dir")
    a = ap.parse_args()
    ok, text = compare(a.orig_dir, a.exported_dir)
    print(text)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
