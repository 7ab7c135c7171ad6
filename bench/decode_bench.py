#!/usr/bin/python3
"""CPU decode at a real model's shape, dtp against llama.cpp (#59 item 4).

    /usr/bin/python3 bench/decode_bench.py --shape 1024            # dim 1024, 8 layers: minutes
    /usr/bin/python3 bench/decode_bench.py --shape 1b --reps 2     # Llama-3.2-1B's shape, 4.9 GB: slow

What it does, in order (the folders and files are kept in --work and reused):
1. Makes the random float32 HF folder of --shape (bench/make_random_hf.py):
   1b: hidden 2048, 16 layers, 32/8 heads, intermediate 8192, vocabulary
   128256, tied (4.94 GB); 1024: hidden 1024, 8 layers, 16/4 heads, 4096,
   32000, tied (0.60 GB).
2. Writes it as GGUF in F32, F16 and Q8_0 (bench/hf_to_gguf.py, our own
   writer) and installs npm's node-llama-cpp into --work (its prebuilt
   llama.cpp binaries); without npm the llama.cpp rows are left out.
3. Measures the memory read bandwidth (bench/membw.cpp, built with g++:
   threads summing 64-bit words of a 1 GiB buffer, best of 5; again after
   each round, keeping the best, since others' work lowers it too; the
   2-thread figure is the floor's).
4. Checks that dtp and llama.cpp (F32) pick the same greedy tokens on a tiny
   untied folder (dim 256, 2 layers, vocabulary 512), fed the same token ids
   (dtp's byte tokenizer: a byte's id is its value), with
   build/bench/dtp_decode_profile at TP 1 and 2; it stops on a mismatch.
5. Runs the contenders interleaved (A B C ... A B C ...), --reps rounds:
   llama.cpp F32/F16/Q8_0 with 2 threads; dtp-generate at TP 1 (one rank,
   2 threads) and TP 2 (dtprun -n 2, 1 thread per rank) in float32, and in
   bfloat16 (--dtype bfloat16) and int8 (--quantize int8) where this
   dtp-generate accepts those flags (tried on the tiny folder first).
   Each run: a prompt of --prompt token ids (prefill), then --tokens greedy
   tokens. llama.cpp's prefill is the prompt less its last token, which the
   first decode step reads.
6. Prints one table, the minimum over rounds of each run's median decode
   step, the best prefill rate, the peak resident memory per rank (the
   largest rank's VmHWM: /usr/bin/time for dtp, node's maxRSS for
   llama.cpp, whose mmap-ed weights count as they are read), and the
   bandwidth floor: the bytes one decode step reads (every matrix once in
   its stored type, the tied head as the embedding table, the norms, and
   the KV cache at the middle of the decode) over the 2-thread bandwidth;
   "of floor" is floor / measured (1.00 = at the floor). Then each dtp row
   over its llama.cpp counterpart (float32 / F32, bfloat16 / F16, int8 /
   Q8_0), by the best rounds and by the median rounds, with every round's
   time: #59's targets.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHAPES = {
    "1b": dict(dim=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256),
    "1024": dict(dim=1024, layers=8, heads=16, kv_heads=4, ffn=4096, vocab=32000),
}
TINY = dict(dim=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=512)
TEXT = "The quick brown fox jumps over the lazy dog; a decode step reads every weight once. "


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def sh(cmd, env=None, timeout=3600, check=True):
    t = time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="replace", timeout=timeout)
    if check and r.returncode != 0:
        sys.exit(f"decode_bench: {' '.join(cmd)} failed ({r.returncode}) after {time.time() - t:.0f} s:\n"
                 f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return r


def make_folder(path, s, tie):
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return
    cmd = [sys.executable, os.path.join(HERE, "make_random_hf.py"), path, "--dim", str(s["dim"]),
           "--layers", str(s["layers"]), "--heads", str(s["heads"]), "--kv-heads", str(s["kv_heads"]),
           "--ffn", str(s["ffn"]), "--vocab", str(s["vocab"])] + (["--tie"] if tie else [])
    log(sh(cmd).stdout.strip())


def make_gguf(folder, kind):
    out = f"{folder}-{kind}.gguf"
    if not os.path.exists(out):
        log(sh(["/usr/bin/python3", os.path.join(HERE, "hf_to_gguf.py"), folder, out + ".part", "--type", kind])
            .stdout.strip())
        os.rename(out + ".part", out)
    return out


def install_node_llama_cpp(work):
    mods = os.path.join(work, "node")
    if os.path.exists(os.path.join(mods, "node_modules", "node-llama-cpp")):
        return mods
    if not shutil.which("npm") or not shutil.which("node"):
        log("decode_bench: no npm/node here (apt-get install nodejs npm): the llama.cpp rows are left out.")
        return None
    os.makedirs(mods, exist_ok=True)
    r = sh(["npm", "install", "--prefix", mods, "--no-audit", "--no-fund", "node-llama-cpp"], check=False)
    if r.returncode != 0:
        log(f"decode_bench: npm install node-llama-cpp failed, the llama.cpp rows are left out:\n{r.stderr[-2000:]}")
        return None
    return mods


def bandwidth(work):
    exe = os.path.join(work, "membw")
    sh(["g++", "-O3", "-march=native", "-pthread", os.path.join(HERE, "membw.cpp"), "-o", exe])
    rows = [json.loads(line) for line in sh([exe, "1024", "5", "1", "2"]).stdout.split("\n") if line.strip()]
    return {r["threads"]: r["gbs"] for r in rows}


def prompt_ids(n):
    text = (TEXT * (n // len(TEXT) + 1))[:n]
    return text, list(text.encode())


def llama_cpp(mods, gguf, ids, tokens, context, threads=2):
    r = sh(["node", os.path.join(HERE, "llama_cpp_decode.mjs"), "--modules", mods, "--model", gguf,
            "--prompt-ids", ",".join(map(str, ids)), "--tokens", str(tokens), "--threads", str(threads),
            "--context", str(context)])
    out = json.loads(r.stdout.strip().split("\n")[-1])
    steps = sorted(out["step_ms"][1:])  # the first step follows the prefill
    return dict(ms=steps[len(steps) // 2], prefill=1000 * out["prefill_tokens"] / out["prefill_ms"],
                rss=out["peak_rss_kb"] * 1024 / 1e9, tokens=out["tokens"])


def dtprun(build, n, threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    return [os.path.join(build, "apps", "dtprun", "dtprun"), "-n", str(n)], env


def dtp_generate(build, folder, text, tokens, context, tp, extra):
    pre, env = dtprun(build, tp, 2 // tp)
    cmd = pre + ["/usr/bin/time", "-f", "maxrss_kb %M", os.path.join(build, "apps", "dtp-generate"), "--hf", folder,
                 "--prompt", text, "--tokens", str(tokens), "--context", str(context)] + extra
    r = sh(cmd, env=env)
    m = re.search(r"prefill ([\d.]+) ms(?: \(\d+ collectives\))?, decode ([\d.]+) ms/token p50", r.stdout)
    if not m:
        sys.exit(f"decode_bench: no latency line from {' '.join(cmd)}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    rss = max(int(k) for k in re.findall(r"maxrss_kb (\d+)", r.stdout + r.stderr)) * 1024 / 1e9
    return dict(ms=float(m.group(2)), prefill=1000 * len(text) / float(m.group(1)), rss=rss)


def dtp_tokens(build, folder, ids, tokens, tp):
    pre, env = dtprun(build, tp, 2 // tp)
    r = sh(pre + [os.path.join(build, "bench", "dtp_decode_profile"), "--hf", folder,
                  "--prompt-ids", ",".join(map(str, ids)), "--tokens", str(tokens)], env=env)
    m = re.search(r"tokens:([\d,]+)", r.stdout)
    return [int(t) for t in m.group(1).split(",")]


def accepts(build, tiny, flags):
    pre, env = dtprun(build, 1, 2)
    r = sh(pre + [os.path.join(build, "apps", "dtp-generate"), "--hf", tiny, "--prompt", "The ", "--tokens", "2"]
           + flags, env=env, check=False)
    return r.returncode == 0


def floor_bytes(s, stored_bytes, kv_bytes, position):
    hd = s["dim"] // s["heads"]
    per_layer = 2 * s["dim"] * s["dim"] + 2 * s["kv_heads"] * hd * s["dim"] + 3 * s["dim"] * s["ffn"]
    matrices = s["layers"] * per_layer + s["vocab"] * s["dim"]  # the tied head reads the whole table
    norms = 4 * (2 * s["layers"] + 1) * s["dim"]
    kv = 2 * s["layers"] * s["kv_heads"] * hd * position * kv_bytes
    return matrices * stored_bytes + norms + kv


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1024")
    ap.add_argument("--work", default="/tmp/dtp-decode-bench", help="folders, GGUF files, node-llama-cpp")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--reps", type=int, default=2, help="interleaved rounds; the table keeps each row's best")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens (prefill)")
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens generated per run")
    ap.add_argument("--skip-check", action="store_true", help="leave out step 4, the greedy-token check")
    ap.add_argument("--only", default="", help="comma-separated row names to run (default all), e.g. dtp-f32-tp1")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    s = SHAPES[a.shape]
    folder = os.path.join(a.work, f"hf-{a.shape}")
    tiny = os.path.join(a.work, "hf-tiny")
    make_folder(folder, s, tie=True)
    make_folder(tiny, TINY, tie=False)
    mods = install_node_llama_cpp(a.work)
    bw = bandwidth(a.work)
    log(f"decode_bench: memory read bandwidth {bw[1]:.1f} GB/s (1 thread), {bw[2]:.1f} GB/s (2 threads)")
    text, ids = prompt_ids(a.prompt)
    context = a.prompt + a.tokens + 8

    # 4. The same greedy tokens, on the tiny folder.
    if mods and not a.skip_check:
        _, tiny_ids = prompt_ids(32)
        want = llama_cpp(mods, make_gguf(tiny, "f32"), tiny_ids, 24, 64)["tokens"]
        for tp in (1, 2):
            got = dtp_tokens(a.build, tiny, tiny_ids, 24, tp)
            if got != want:
                sys.exit(f"decode_bench: greedy tokens differ on {tiny}: dtp TP={tp} {got}, llama.cpp F32 {want}.")
        log(f"decode_bench: dtp TP=1, TP=2 and llama.cpp F32 pick the same 24 greedy tokens on {tiny}: {want}")

    # 5. The contenders: (name, what, stored bytes per weight, KV bytes per element, run()).
    rows = []
    if mods:
        for kind, nbytes in (("F32", 4), ("F16", 2), ("Q8_0", 34 / 32)):
            gguf = make_gguf(folder, kind.lower())
            rows.append((f"llama.cpp-{kind.lower()}", f"llama.cpp {kind}", "1 (2 threads)", nbytes, 2,
                         lambda g=gguf: llama_cpp(mods, g, ids, a.tokens, context)))
    variants = [("f32", "float32", [], 4, 4)]
    if accepts(a.build, tiny, ["--dtype", "bfloat16"]):
        variants.append(("bf16", "bfloat16 weights", ["--dtype", "bfloat16"], 2, 4))
    else:
        log("decode_bench: this dtp-generate does not take --dtype bfloat16: no bfloat16 rows.")
    if accepts(a.build, tiny, ["--quantize", "int8"]):
        variants.append(("int8", "int8 weights", ["--quantize", "int8"], 1 + 2 / 32, 4))  # float16 scales
    else:
        log("decode_bench: this dtp-generate does not take --quantize int8: no int8 rows.")
    for short, what, flags, nbytes, kvb in variants:
        for tp in (1, 2):
            rows.append((f"dtp-{short}-tp{tp}", f"dtp {what}", f"{tp} ({2 // tp} thread{'s' if tp == 1 else ''}/rank)",
                         nbytes, kvb, lambda tp=tp, f=flags: dtp_generate(a.build, folder, text, a.tokens, context, tp, f)))
    if a.only:
        keep = set(a.only.split(","))
        rows = [r for r in rows if r[0] in keep]
    best, loads, every = {}, [], {}
    for rep in range(a.reps):
        for name, *_, run in rows:
            t = time.time()
            m = run()
            load = os.getloadavg()[0]
            loads.append(load)
            log(f"decode_bench: round {rep + 1}/{a.reps} {name}: {m['ms']:.1f} ms/token, prefill "
                f"{m['prefill']:.0f} tokens/s, peak {m['rss']:.2f} GB/rank ({time.time() - t:.0f} s, load {load:.1f})")
            every.setdefault(name, []).append(m["ms"])
            b = best.setdefault(name, dict(m))
            b["ms"], b["prefill"], b["rss"] = min(b["ms"], m["ms"]), max(b["prefill"], m["prefill"]), max(b["rss"], m["rss"])
        # Others' work on the machine lowers the bandwidth measured too: the floor takes the best measurement.
        bw = {k: max(v, w) for (k, v), w in zip(sorted(bw.items()), (lambda b: [b[1], b[2]])(bandwidth(a.work)))}
        log(f"decode_bench: read bandwidth, best so far: {bw[1]:.1f} GB/s (1 thread), {bw[2]:.1f} GB/s (2 threads)")

    # 6. The table.
    print(f"\n{a.shape}: hidden {s['dim']}, {s['layers']} layers, {s['heads']}/{s['kv_heads']} heads, "
          f"intermediate {s['ffn']}, vocabulary {s['vocab']}, tied; prompt {a.prompt}, {a.tokens} tokens, "
          f"best of {a.reps} interleaved rounds; read bandwidth {bw[2]:.1f} GB/s (2 threads), {bw[1]:.1f} (1); "
          f"1-minute load average {min(loads):.1f}-{max(loads):.1f} over the runs (2 CPUs: above 2, others' work "
          f"shared them)")
    print("\n| contender | TP | decode ms/token | prefill tokens/s | peak RSS/rank GB | floor ms | of floor |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, what, tp, nbytes, kvb, _ in rows:
        b = best[name]
        floor_ms = floor_bytes(s, nbytes, kvb, a.prompt + a.tokens // 2) / (bw[2] * 1e9) * 1e3
        print(f"| {what} | {tp} | {b['ms']:.1f} | {b['prefill']:.0f} | {b['rss']:.2f} | {floor_ms:.1f} | "
              f"{floor_ms / b['ms']:.2f} |")
    # #59's targets compare each dtp format with llama.cpp's: by the best
    # rounds (the table) and by the median rounds, which one slow round of
    # either side moves less.
    pairs = [(f"dtp-{d}-tp{tp}", f"llama.cpp-{l}") for d, l in (("f32", "f32"), ("bf16", "f16"), ("int8", "q8_0"))
             for tp in (1, 2)]
    pairs = [(d, l) for d, l in pairs if d in every and l in every]
    if pairs:
        print("\n| dtp / llama.cpp | best rounds | median rounds | each round's ms (dtp; llama.cpp) |\n|---|---:|---:|---|")
        for d, l in pairs:
            print(f"| {d} / {l} | {min(every[d]) / min(every[l]):.2f}x | "
                  f"{statistics.median(every[d]) / statistics.median(every[l]):.2f}x | "
                  f"{', '.join(f'{v:.1f}' for v in every[d])}; {', '.join(f'{v:.1f}' for v in every[l])} |")


if __name__ == "__main__":
    main()
