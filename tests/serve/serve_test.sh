#!/usr/bin/env bash
# dtp-serve end to end at TP=2 with OpenAI's Node client:
#   serve_test.sh DTPRUN DTP_TRAIN DTP_SERVE GREEDY_REFERENCE TINY_CHATML NPM_CACHE [--bench|--soak]
# - dtp-train exports a tiny model (byte vocabulary); a copy gets the
#   tiny-chatml tokenizer.json and ChatML template for chat;
# - by default (the checks):
#   - one server per folder (dtprun -n 2 dtp-serve --port 0), then the client
#     checks (serve_test.mjs): greedy tokens equal models::generate's for
#     each prompt alone (greedy_reference at TP=2, dtp-generate's code path),
#     8 concurrent requests equal the same requests alone, streamed text
#     equals non-streamed, stop strings, usage, and 4xx bodies naming the
#     field;
#   - a third server with a KV pool too small for its batch, 4-token blocks
#     and 5-token prefill chunks (serve_paged_test.mjs): concurrent requests
#     equal generate's through preemptions, an aborted stream stops and
#     returns its blocks, and rank 1 killed mid-request gives 503s naming it
#     and a non-zero exit of the whole job within 20 s;
#   - SIGTERM to every rank of the first two: dtprun (and so every rank)
#     exits 0 within 10 s;
# - --soak: 1000 requests (serve_soak.mjs): every KV block back at the end,
#   the ranks' memory flat;
# - --bench: the load test (serve_bench.mjs, 64 clients x 10 requests and
#   one at a time) on a larger model; prints figures, asserts no timing
#   (DTP_SERVE_BENCH_FLAGS: other dtp-serve flags).
# Skips (exit 0, "serve_test: SKIP") when npm cannot install `openai`.
set -euo pipefail
dtprun=$1 train=$2 serve=$3 reference=$4 chatml=$5
cache=$(mkdir -p "$6" && realpath "$6")
mode=${7:-}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
fail() { echo "serve_test: FAILED: $*"; exit 1; }

package=openai@6.30.1
exec 9> "$cache/.install.lock"
flock 9
if [ ! -e "$cache/installed-$package" ]; then
  [ -f "$cache/package.json" ] || echo '{"private": true}' > "$cache/package.json"
  if ! timeout 300 npm install --prefix "$cache" --no-audit --no-fund --ignore-scripts --loglevel=error "$package"; then
    echo "serve_test: SKIP: npm could not install $package (offline?)"
    exit 0
  fi
  touch "$cache/installed-$package"
fi
flock -u 9

d=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  rm -rf "$d"
}
trap cleanup EXIT

if [ "$mode" = --bench ]; then
  # Big enough that a step is compute rather than overhead: 4 layers of 256.
  "$dtprun" -n 1 "$train" --steps 20 --dim 256 --layers 4 --heads 8 --seq 64 --save-hf "$d/hf" > "$d/train.log" 2>&1 ||
    fail "$(cat "$d/train.log")"
else
  "$dtprun" -n 1 "$train" --steps 100 --dim 32 --seq 32 --save-hf "$d/hf" > "$d/train.log" 2>&1 || fail "$(cat "$d/train.log")"
fi
cp -r "$d/hf" "$d/chat"
cp "$chatml/tokenizer.json" "$chatml/tokenizer_config.json" "$d/chat/"

# start NAME FOLDER [dtp-serve flags]: a server in the background; sets
# NAME_port, NAME_pid (dtprun's) and NAME_rank1 (rank 1's process).
start() {
  local name=$1 folder=$2
  shift 2
  "$dtprun" -n 2 "$serve" --hf "$folder" --port 0 "$@" > "$d/$name.log" 2>&1 &
  local pid=$! port=""
  pids+=("$pid")
  for _ in $(seq 1 600); do
    port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$d/$name.log" | grep -o '[0-9]*$' || true)
    [ -n "$port" ] && break
    kill -0 "$pid" 2>/dev/null || fail "$name server exited: $(cat "$d/$name.log")"
    sleep 0.1
  done
  [ -n "$port" ] || fail "$name server not listening after 60 s: $(cat "$d/$name.log")"
  local rank1=""
  for p in $(pgrep -P "$pid"); do
    tr '\0' '\n' < "/proc/$p/environ" | grep -qx RANK=1 && rank1=$p
  done
  [ -n "$rank1" ] || fail "$name: no rank 1 process under dtprun $pid"
  eval "${name}_port=$port; ${name}_pid=$pid; ${name}_rank1=$rank1"
}
export DTP_NPM_PREFIX="$cache"

if [ "$mode" = --bench ]; then
  # DTP_SERVE_BENCH_FLAGS: dtp-serve flags instead of "--prefill-chunk 256", e.g. "--prefill-chunk 32".
  # shellcheck disable=SC2086
  start bench "$d/hf" --context 256 --max-batch 32 ${DTP_SERVE_BENCH_FLAGS:---prefill-chunk 256}
  grep -o 'listening on.*' "$d/bench.log"
  node "$here/serve_bench.mjs" "http://127.0.0.1:$bench_port/v1" 64 10 || fail "bench"
  echo "serve_test: ok"
  exit 0
fi
if [ "$mode" = --soak ]; then
  start soak "$d/hf" --context 64 --max-batch 8 --block-size 4 --kv-cache-blocks 48 --prefill-chunk 8
  node "$here/serve_soak.mjs" "http://127.0.0.1:$soak_port/v1" 1000 "$(pgrep -P "$soak_pid" | tr '\n' ',')" ||
    fail "soak: node exited $? (server log: $(tail -5 "$d/soak.log"))"
  echo "serve_test: ok"
  exit 0
fi

start base "$d/hf" --context 64 --max-batch 8
start chat "$d/chat" --context 64 --max-batch 8
node "$here/serve_test.mjs" "http://127.0.0.1:$base_port/v1" "http://127.0.0.1:$chat_port/v1" \
  "$dtprun" "$reference" "$d" || fail "client checks (server logs: $(tail -5 "$d/base.log"; tail -5 "$d/chat.log"))"

# Paging, preemption, chunked prefill and faults (this server dies in it).
# A sequence of 256 tokens needs 64 blocks of 4; 80 cannot hold 8 running.
start paged "$d/hf" --context 256 --max-batch 8 --block-size 4 --kv-cache-blocks 80 --prefill-chunk 5 --max-prefill 2
node "$here/serve_paged_test.mjs" "http://127.0.0.1:$paged_port/v1" "$dtprun" "$reference" "$d" "$paged_rank1" ||
  fail "paged checks (server log: $(tail -20 "$d/paged.log"))"
status=0
timeout 20 tail --pid="$paged_pid" -f /dev/null || fail "paged: the job still runs 20 s after rank 1 was killed: $(tail -5 "$d/paged.log")"
wait "$paged_pid" || status=$?
[ "$status" -ne 0 ] || fail "paged: dtprun exited 0 after rank 1 was killed: $(tail -5 "$d/paged.log")"
grep -q "rank 1 (pid $paged_rank1) exited" "$d/paged.log" || fail "paged: the log does not name rank 1: $(tail -10 "$d/paged.log")"
echo "serve_test: a killed rank 1: dtprun exited $status; $(grep -m1 -o 'dtp-serve: rank 1.*' "$d/paged.log" | cut -c1-120)"

# SIGTERM to every rank (as a scheduler would): each exits 0, so dtprun does.
for name in base chat; do
  pid=${name}_pid
  for rank in $(pgrep -P "${!pid}"); do kill -TERM "$rank"; done
done
for name in base chat; do
  pid=${name}_pid
  status=0
  timeout 10 tail --pid="${!pid}" -f /dev/null || fail "$name: ranks still running 10 s after SIGTERM"
  wait "${!pid}" || status=$?
  [ "$status" -eq 0 ] || fail "$name: dtprun exited $status after SIGTERM: $(tail -5 "$d/$name.log")"
  grep -q "dtp-serve: stopped" "$d/$name.log" || fail "$name: no 'stopped' line: $(tail -5 "$d/$name.log")"
done
pids=()
echo "serve_test: ok"
