"""Check what dtp computed (hf_check) against llama_reference.py.

--expect names what the got file must hold (default: logits):

- logits: logits_f64 and logits_f32 [batch, seq, vocab].
  float64: max |got_f64 - ref_f64| <= 1e-12 * max(1, max |ref_f64|) (the same
  function up to float64 rounding; the rotary row permutation is exact).
  float32: max |got_f32 - ref_f64| <= 4 * max |ref_f32 - ref_f64|
  + 16 * 5.96e-8 * max |ref_f64|.
- greedy: greedy_f64 [batch, N] equal, token for token, to the reference's.
- loss: loss_f64, the mean cross-entropy of the reference's float64 logits
  against input_ids.roll(-1, 1), within 1e-12 relative.
- aux: aux_f64, the MoE load-balancing loss, within 1e-12 relative.

    python3 tests/hf/compare_logits.py /tmp/ref.safetensors /tmp/got.safetensors --expect logits,greedy

Prints the figures in one line and exits 0 when all hold, 1 otherwise.
"""

import argparse
import sys

import torch
import torch.nn.functional as F
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


def check_logits(ref, got, problems):
    """The logits' figures, appending to problems when a bound fails."""
    want = ref["logits_f64"]
    shape = list(want.shape)
    # A float32 run that computed in float64 would pass trivially: check dtypes.
    before = len(problems)
    check_tensor("logits_f64", got.get("logits_f64"), torch.float64, shape, problems)
    check_tensor("logits_f32", got.get("logits_f32"), torch.float32, shape, problems)
    if len(problems) > before:
        return "logits: " + "; ".join(problems[before:]) + " (as in the reference)"
    scale = want.abs().max().item()
    f64_bound = F64_BOUND * max(1.0, scale)
    d64 = max_abs_diff(got["logits_f64"], want)
    hf_f32 = max_abs_diff(ref["logits_f32"], want)
    f32_bound = 4 * hf_f32 + 16 * F32_UNIT_ROUNDOFF * scale
    d32 = max_abs_diff(got["logits_f32"], want)
    ok = d64 <= f64_bound and d32 <= f32_bound
    if not ok:
        problems.append("logits")
    return (f"logits {shape}: float64 max|got-ref| {d64:.3g} (bound {f64_bound:.3g}), "
            f"float32 max|got-ref_f64| {d32:.3g} (bound {f32_bound:.3g}; "
            f"HF's float32 {hf_f32:.3g}, max|ref| {scale:.3g}): {'ok' if ok else 'FAILED'}")


def check_greedy(ref, got, problems):
    want = ref.get("greedy_f64")
    if want is None:
        problems.append("greedy")
        return "greedy: the reference has no greedy_f64 (run llama_reference.py with --greedy N)"
    t = got.get("greedy_f64")
    if t is None or t.shape != want.shape or not torch.equal(t, want):
        problems.append("greedy")
        return f"greedy: got {None if t is None else t.tolist()}, expected {want.tolist()}: FAILED"
    return f"greedy {list(want.shape)}: token for token: ok"


def check_loss(ref, got, problems):
    logits = ref["logits_f64"]
    targets = ref["input_ids"].roll(-1, 1)
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    t = got.get("loss_f64")
    if t is None or t.dtype != torch.float64:
        problems.append("loss")
        return f"loss: got {t}, expected a float64 loss_f64: FAILED"
    d = abs(t.item() - want)
    bound = F64_BOUND * max(1.0, abs(want))
    ok = d <= bound
    if not ok:
        problems.append("loss")
    return f"loss {t.item():.15g} vs {want:.15g}: |diff| {d:.3g} (bound {bound:.3g}): {'ok' if ok else 'FAILED'}"


def check_aux(ref, got, problems):
    want, t = ref.get("aux_f64"), got.get("aux_f64")
    if want is None or t is None or t.dtype != torch.float64:
        problems.append("aux")
        return f"aux: got {t}, reference {want}: FAILED"
    d = abs(t.item() - want.item())
    bound = F64_BOUND * max(1.0, abs(want.item()))
    if d > bound:
        problems.append("aux")
    return f"aux {t.item():.15g}: |diff| {d:.3g} (bound {bound:.3g}): {'ok' if d <= bound else 'FAILED'}"


CHECKS = {"logits": check_logits, "greedy": check_greedy, "loss": check_loss, "aux": check_aux}


def compare(reference, got, expect="logits"):
    """(ok, the figures in one line) of `got` against `reference` (paths)."""
    ref, out = load_file(reference), load_file(got)
    problems = []
    lines = []
    for name in expect.split(","):
        if name not in CHECKS:
            raise SystemExit(f"compare_logits: --expect {name!r}, expected some of {sorted(CHECKS)}")
        lines.append(CHECKS[name](ref, out, problems))
    return not problems, "; ".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference", help="written by llama_reference.py")
    ap.add_argument("got", help="written by hf_check")
    ap.add_argument("--expect", default="logits", help="comma-separated: " + ", ".join(CHECKS))
    a = ap.parse_args()
    ok, line = compare(a.reference, a.got, a.expect)
    print(line)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
