#!/usr/bin/env bash
# The GPU checks of one go on a machine with one or more NVIDIA GPUs and the
# torch wheel (no apt, no network), from the project root, with the carry of
# scripts/gpu-carry.sh copied to .gpu/:
#
#   scripts/gpu-check.sh [OUTDIR]      # default: $OUT, else gpu-out
#
# Builds with scripts/wheel.sh (NCCL on), then, most telling first: the cuda
# tests, dtp-train --device cuda --check-parity in float64, dtp-bench
# --device cuda (with --profile: Kineto traces and top host ops), dtp-bench
# --decode --device cuda, a checkpoint saved from the GPU and dtp-generate
# --device cuda on it, the LOCAL_RANK mapping, and the whole suite three
# times. Each step has a time limit and goes on after a failure; the whole
# stays within DTP_GPU_BUDGET seconds (default 500: device time is short),
# skipping what no longer fits. DTP_GPU_STEPS="a b" runs only those steps
# (a second call on a warm machine: the build is then a no-op);
# DTP_GPU_SUITE_EXCLUDE=REGEX leaves those tests out of the suite runs. OUTDIR gets
# summary.txt (also printed last), logs.tar.gz and the medium size's traces.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-${OUT:-gpu-out}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
logs=$(mktemp -d)
summary=$out/summary.txt
budget=${DTP_GPU_BUDGET:-500}
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
want() { [ -z "${DTP_GPU_STEPS:-}" ] || [[ " $DTP_GPU_STEPS " == *" $1 "* ]]; }
# step NAME LIMIT_S CMD...: runs CMD with a limit (cut to what the budget has left), its output in
# NAME.log; says rc and seconds. Skipped (rc 125) when not wanted or when under 20 s are left.
step() {
  local name=$1 limit=$2 t0=$SECONDS rc left
  shift 2
  want "$name" || return 125
  left=$((budget - SECONDS - 10))
  if [ "$left" -lt 20 ]; then
    say "== $name: skipped, the budget of $budget s is spent"
    return 125
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout --kill-after=5 "$limit" "$@" >"$logs/$name.log" 2>&1
  rc=$?
  say "== $name: rc $rc, $((SECONDS - t0)) s"
  return $rc
}
finish() {
  tar -czf "$out/logs.tar.gz" -C "$logs" . 2>/dev/null
  echo
  cat "$summary"
}
trap finish EXIT

nvidia-smi -L >"$logs/nvidia-smi.log" 2>&1
say "machine: $(head -1 "$logs/nvidia-smi.log"); $(nproc) cores; torch $(python3 -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())))' 2>&1)"

export DTP_DEBS=.gpu/debs DTP_GLOO_INCLUDE
DTP_GLOO_INCLUDE=$(ls -d .gpu/gloo-* | head -1)
step build 300 scripts/wheel.sh
rc=$?
grep -E "^wheel:" "$logs/build.log" | sed 's/^/  /' | tee -a "$summary"
if [ "$rc" != 0 ] && [ "$rc" != 125 ]; then
  tail -30 "$logs/build.log" | tee -a "$summary"
  step build-keep-going 200 cmake --build build-wheel -j "$(nproc)" -- -k 0
  grep -E -m 30 "error|Error" "$logs/build-keep-going.log" | tee -a "$summary"
  exit 1
fi
bin=$PWD/build-wheel/apps
export LD_LIBRARY_PATH=$PWD/build-wheel/deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
corpus=$PWD/build-wheel/deps/usr/share/games/fortunes

step cuda-tests 120 bash -c "cd build-wheel && ctest -L cuda -V"
grep -E "^\s*[0-9]+: \[ +(OK|FAILED|SKIPPED) +\]" "$logs/cuda-tests.log" 2>/dev/null | sed 's/^/  /' | tee -a "$summary"

step train-parity 120 "$bin/dtp-train" --device cuda --dtype float64 --check-parity --steps 20 --data "$corpus"
grep -iE "parity|distance|loss" "$logs/train-parity.log" 2>/dev/null | tail -4 | sed 's/^/  /' | tee -a "$summary"

step bench-device 150 "$bin/dtp-bench" --device cuda --sizes small medium large --reps 21 --warmup 3 --profile "$logs/prof"
grep -E "^\||dtp-bench|host:" "$logs/bench-device.log" 2>/dev/null | head -80 | tee -a "$summary"
cp "$logs"/prof/medium-*.json "$out/" 2>/dev/null

step bench-decode 120 "$bin/dtp-bench" --decode --device cuda --decode-sizes d256 d512 d1024 --batches 1 8
grep -E "^\||Target|dtp-bench" "$logs/bench-decode.log" 2>/dev/null | tee -a "$summary"

step train-save 60 "$bin/dtp-train" --device cuda --steps 100 --data "$corpus" --save "$logs/ck"
tail -2 "$logs/train-save.log" 2>/dev/null | sed 's/^/  /' | tee -a "$summary"
step generate 60 "$bin/dtp-generate" --device cuda --checkpoint "$logs/ck" --prompt "The meaning of life is" \
  --prompt "A friend" --max-new-tokens 32 --seed 3 --top-k 20 --temperature 0.8
tail -3 "$logs/generate.log" 2>/dev/null | sed 's/^/  /' | tee -a "$summary"

# LOCAL_RANK: two ranks asking for GPUs 0 and 1 (one GPU here: rank 1 must say so).
step local-rank 60 "$bin/dtprun/dtprun" -n 2 "$bin/dtp-train" --device cuda --steps 2 --data "$corpus"
grep -iE "LOCAL_RANK|error|cuda:" "$logs/local-rank.log" 2>/dev/null | head -6 | sed 's/^/  /' | tee -a "$summary"

suite() {
  step "suite$1" 200 bash -c "cd build-wheel && ctest -j $(nproc) --output-on-failure ${DTP_GPU_SUITE_EXCLUDE:+-E '$DTP_GPU_SUITE_EXCLUDE'}" || true
  [ -f "$logs/suite$1.log" ] || return
  sed -n '/tests passed/p; /The following tests FAILED/,$p' "$logs/suite$1.log" | grep -v "^Errors while" | head -60 |
    sed "s/^/  run $1: /" | tee -a "$summary"
  say "  run $1: $(grep -c " Passed " "$logs/suite$1.log") tests passed before it ended"
}
suite 1
# Backtraces of up to 6 tests that crashed (no gdb there: cuda-gdb debugs host code too), each run from
# its own test program, and the libraries dtp_tests binds first (std:: symbols must come from
# libstdc++, not from libtorch.so's copies: pytorch#133437, NOTE: [libstdc++ before libtorch] in CMakeLists.txt).
grep -oE "Test +#[0-9]+: [A-Za-z0-9_./]+ \.+\*\*\*Exception: (SegFault|Numerical|Illegal)" "$logs/suite1.log" 2>/dev/null |
  awk '{print $3}' | head -6 >"$logs/crashed.txt"
while read -r t; do
  [ $((budget - SECONDS)) -lt 150 ] && { say "== backtrace of $t: skipped, the budget is nearly spent"; continue; }
  cmdline=$(cd build-wheel && ctest -N -V -R "^$t( |\$)" | sed -n 's/^.*Test command: //p' | head -1)
  say "== backtrace of $t ($cmdline)"
  (cd build-wheel/tests && eval "timeout 60 cuda-gdb -batch -ex run -ex bt --args $cmdline") >"$logs/bt-${t//\//_}.log" 2>&1
  grep -E "^#[0-9]+|signal" "$logs/bt-${t//\//_}.log" | head -16 | cut -c1-240 | tee -a "$summary"
done <"$logs/crashed.txt"
[ -s "$logs/crashed.txt" ] && readelf -d build-wheel/tests/dtp_tests | grep -m3 NEEDED | tee -a "$summary"
suite 2
suite 3
