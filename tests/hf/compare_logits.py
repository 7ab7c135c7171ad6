"""Check logits computed by dtp (hf_check) against llama_reference.py's.

Both files hold logits_f64 and logits_f32 [batch, seq, vocab]:

- float64: max |got_f64 - ref_f64| <= 1e-12 (the same function up to float64
  rounding; the rotary row permutation is exact).
- float32: max |got_f32 - ref_f64| <= 4 * max |ref_f32 - ref_f64|
  + 16 * 5.96e-8 * max |ref_f64|.

    python3 tests/hf/compare_logits.py /tmp/ref.safetensors /tmp/got.safetensors

Prints the figures in one line and exits 0 when both hold, 1 otherwise.
"""

import argparse
import sys

import torch
from safetensors.torch import load_file

F64_BOUND = 1e-12
# NOTE: [Float32 parity tolerance] in tests/llama_test.cpp: in float32 dtp
# sums in another order than HF, so it cannot equal HF's float32 logits; it
# must be as exact as HF's own float32 computation. Both are measured against
# the float64 reference: dtp may be up to 4x HF's float32 error (another
# order is another random rounding of the same size, and the max of such
# errors varies ~2x between orders), plus 16 ulps of the logits' scale for
# when HF happens to be nearly exact.
F32_UNIT_ROUNDOFF = 5.96e-8  # 2^-24


def max_abs_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


def check_tensor(name, t, dtype, shape, problems):
    """A problem when `t` is missing or not of the given dtype and shape."""
    if t is None:
        problems.append(f"{name}: missing")
    elif t.dtype != dtype or list(t.shape) != shape:
        problems.append(f"{name}: got {t.dtype}{list(t.shape)}, expected {dtype}{shape}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference", help="written by llama_reference.py")
    ap.add_argument("got", help="written by hf_check")
    a = ap.parse_args()
    ref, got = load_file(a.reference), load_file(a.got)
    want = ref["logits_f64"]
    shape = list(want.shape)
    problems = []
    # A float32 run that computed in float64 would pass trivially: check dtypes.
    check_tensor("logits_f64", got.get("logits_f64"), torch.float64, shape, problems)
    check_tensor("logits_f32", got.get("logits_f32"), torch.float32, shape, problems)
    if problems:
        print(f"{a.got}: " + "; ".join(problems) + " (as in the reference)")
        sys.exit(1)

    d64 = max_abs_diff(got["logits_f64"], want)
    hf_f32 = max_abs_diff(ref["logits_f32"], want)
    scale = want.abs().max().item()
    f32_bound = 4 * hf_f32 + 16 * F32_UNIT_ROUNDOFF * scale
    d32 = max_abs_diff(got["logits_f32"], want)
    ok = d64 <= F64_BOUND and d32 <= f32_bound
    print(f"logits {shape}: float64 max|got-ref| {d64:.3g} (bound {F64_BOUND:g}), "
          f"float32 max|got-ref_f64| {d32:.3g} (bound {f32_bound:.3g}; "
          f"HF's float32 {hf_f32:.3g}, max|ref| {scale:.3g}): {'ok' if ok else 'FAILED'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
