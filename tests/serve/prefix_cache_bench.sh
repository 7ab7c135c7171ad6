#!/usr/bin/env bash
# Prefix caching under load, side by side (issue #56 item 4):
#   prefix_cache_bench.sh DTPRUN DTP_TRAIN DTP_SERVE NPM_CACHE [REQUESTS [CLIENTS]]
# dtp-train exports a model (4 layers of 256, byte vocabulary, as
# serve_test.sh --bench, but untrained); then the same dtp-serve
# binary runs twice at TP 2 (dtprun -n 2, --context 512, --max-batch 16,
# the same flags), first without and then with --enable-prefix-caching,
# one server at a time, each loaded by prefix_cache_bench.mjs (REQUESTS=200
# streamed completions, even ones greedy and odd ones seeded, from
# CLIENTS=16 clients, sharing a 400-character system prompt). Prints the
# table: TTFT p50/p99, prompt tokens, prefix cache queries and hits,
# tokens computed. Prints figures
# and asserts no timing; fails (FAILED, exit 1) when a request's text
# differs between the two servers, every request got the same text, or the
# hits are not 0 without caching and > 0 with it.
# DTP_PREFIX_BENCH_FLAGS: other dtp-serve flags for both servers;
# DTP_PREFIX_BENCH_OUT: a folder to keep off.json and on.json in (each
# request's TTFT and text, the /metrics deltas).
set -euo pipefail
dtprun=$1 train=$2 serve=$3
cache=$(realpath "$4")
requests=${5:-200} clients=${6:-16}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
fail() { echo "prefix_cache_bench: FAILED: $*"; exit 1; }
# shellcheck source=port_of.sh
source "$here/port_of.sh"
[ -d "$cache/node_modules/openai" ] || fail "no openai package under $cache (serve_test.sh installs it: build/npm-serve)"
export DTP_NPM_PREFIX="$cache"

d=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  rm -rf "$d"
}
trap cleanup EXIT

# An untrained model (one step at lr 1e-9): trained for 20 steps
# (serve_test.sh --bench), it answers every prompt with 16 spaces, and
# equal outputs would then prove nothing.
"$dtprun" -n 1 "$train" --steps 1 --lr 1e-9 --dim 256 --layers 4 --heads 8 --seq 64 --save-hf "$d/hf" > "$d/train.log" 2>&1 ||
  fail "$(cat "$d/train.log")"

# bench NAME [dtp-serve flags]: a server (as serve_test.sh's start), the
# load, then SIGTERM; the run's figures land in $d/NAME.json.
bench() {
  local name=$1 port
  shift
  # shellcheck disable=SC2086
  "$dtprun" -n 2 "$serve" --hf "$d/hf" --port 0 --context 512 --max-batch 16 ${DTP_PREFIX_BENCH_FLAGS:-} "$@" \
    > "$d/$name.log" 2>&1 &
  local pid=$!
  pids+=("$pid")
  port=$(port_of "$name" "$pid")
  grep -o 'listening on.*' "$d/$name.log"
  node "$here/prefix_cache_bench.mjs" run "http://127.0.0.1:$port/v1" "$requests" "$clients" "$d/$name.json" ||
    fail "$name: the load (server log: $(tail -5 "$d/$name.log"))"
  kill -TERM "$pid"
  wait "$pid" || true
}

bench off
bench on --enable-prefix-caching
grep -q 'prefix caching' "$d/on.log" || fail "the second server's listening line does not say prefix caching"
echo "prefix_cache_bench: machine: $(nproc) CPUs, $(lscpu | grep 'Model name' | sed 's/ \+/ /g'), load average $(cut -d' ' -f1-3 /proc/loadavg)"
if [ -n "${DTP_PREFIX_BENCH_OUT:-}" ]; then
  mkdir -p "$DTP_PREFIX_BENCH_OUT"
  cp "$d/off.json" "$d/on.json" "$DTP_PREFIX_BENCH_OUT/"
fi
node "$here/prefix_cache_bench.mjs" compare "$d/off.json" "$d/on.json" || fail "compare"
echo "prefix_cache_bench: ok"
