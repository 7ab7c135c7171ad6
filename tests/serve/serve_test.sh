#!/usr/bin/env bash
# dtp-serve end to end at TP=2 with OpenAI's Node client:
#   serve_test.sh DTPRUN DTP_TRAIN DTP_SERVE GREEDY_REFERENCE TINY_CHATML NPM_CACHE [--bench|--soak|--stop|--features]
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
# - --stop: SIGTERM while clients hold connections (serve_stop_test.mjs: an
#   idle keep-alive connection, a request sent one byte at a time, open
#   streams), three times: to dtprun (it exits 143 and SIGKILLs what still
#   runs 3 s later: the log must say 'dtp-serve: stopped'), to every rank
#   under dtprun (it exits 0: every rank did), and to two ranks started
#   without dtprun (each exits 0); the streams end as documented and the
#   server closes the connections;
# - --features: a float64 server of the chat folder with prefix caching
#   (serve_features_test.mjs): logprobs equal one device's log_softmax
#   (greedy_reference TOP_K float64) within 1e-9, n choices, their 400s,
#   prefix cache hits, a non-streamed client that aborts is cancelled;
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
# shellcheck source=port_of.sh
source "$here/port_of.sh"

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
  local pid=$! port
  pids+=("$pid")
  port=$(port_of "$name" "$pid")
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
  # DTP_SERVE_BENCH_COMPARE: flags added for a second server of the same build, run right after the
  # first in this same run (e.g. "--two-forwards-per-step"), for figures side by side: the two
  # alternate twice (A B A B), each with the load alone (no one-at-a-time baseline), so that
  # the machine's noise shows.
  base=${DTP_SERVE_BENCH_FLAGS:---prefill-chunk 256}
  variants=("$base")
  per_client=10 baseline=""
  if [ -n "${DTP_SERVE_BENCH_COMPARE:-}" ]; then
    variants=("$base" "$base $DTP_SERVE_BENCH_COMPARE" "$base" "$base $DTP_SERVE_BENCH_COMPARE")
    per_client=5 baseline=--no-baseline
  fi
  i=0
  for flags in "${variants[@]}"; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    start "bench$i" "$d/hf" --context 256 --max-batch 32 $flags
    echo "serve_test: bench $i: dtp-serve $flags"
    grep -o 'listening on.*' "$d/bench$i.log"
    port_var="bench${i}_port"
    node "$here/serve_bench.mjs" "http://127.0.0.1:${!port_var}/v1" 64 $per_client $baseline || fail "bench $i"
    pid_var="bench${i}_pid"
    kill -TERM "${!pid_var}" 2>/dev/null || true
    wait "${!pid_var}" 2>/dev/null || true
  done
  echo "serve_test: ok"
  exit 0
fi
if [ "$mode" = --stop ]; then
  # A grace of 1 s (not the default 2 s) leaves room before dtprun's SIGKILL
  # at 3 s for a loaded machine's slow steps.
  flags=(--hf "$d/hf" --port 0 --context 256 --max-batch 1 --shutdown-grace-s 1)
  # hold NAME PID: serve_stop_test.mjs on NAME's server (PID: its dtprun or
  # rank 0), in the background (its pid in `client`), until it holds its
  # connections.
  hold() {
    local port
    port=$(port_of "$1" "$2")
    node "$here/serve_stop_test.mjs" "http://127.0.0.1:$port/v1" > "$d/$1.client" 2>&1 &
    client=$!
    pids+=("$client")
    for _ in $(seq 1 1200); do
      grep -q 'serve_stop_test: holding' "$d/$1.client" && return
      kill -0 "$client" 2>/dev/null || fail "$1: the client exited before holding its connections: $(cat "$d/$1.client")"
      sleep 0.1
    done
    fail "$1: the client holds no connections after 120 s: $(cat "$d/$1.client")"
  }
  # settle NAME PID...: waits for the processes (30 s at most: a hang bound,
  # not a timing) and the client; checks the client and the 'stopped' line.
  settle() {
    local name=$1 p
    shift
    for p in "$@"; do
      timeout 30 tail --pid="$p" -f /dev/null || fail "$name: still running 30 s after SIGTERM: $(tail -5 "$d/$name.log")"
    done
    wait "$client" || fail "$name: client checks: $(cat "$d/$name.client") (server log: $(tail -5 "$d/$name.log"))"
    grep -q "dtp-serve: stopped" "$d/$name.log" || fail "$name: no 'stopped' line: $(tail -5 "$d/$name.log")"
    echo "serve_test: $name: $(tail -1 "$d/$name.client")"
  }
  # 1. SIGTERM to dtprun: forwarded to the ranks; what runs 3 s later is killed.
  "$dtprun" -n 2 "$serve" "${flags[@]}" > "$d/dtprun.log" 2>&1 &
  job=$!
  pids+=("$job")
  hold dtprun "$job"
  kill -TERM "$job"
  settle dtprun "$job"
  status=0
  wait "$job" || status=$?
  [ "$status" -eq 143 ] || fail "dtprun exited $status after SIGTERM, expected 143 (128 + SIGTERM): $(tail -5 "$d/dtprun.log")"
  # 2. SIGTERM to every rank under dtprun (as a scheduler would): dtprun
  # exits 0 when every rank did.
  "$dtprun" -n 2 "$serve" "${flags[@]}" > "$d/ranks.log" 2>&1 &
  job=$!
  pids+=("$job")
  hold ranks "$job"
  for rank in $(pgrep -P "$job"); do kill -TERM "$rank"; done
  settle ranks "$job"
  status=0
  wait "$job" || status=$?
  [ "$status" -eq 0 ] || fail "dtprun exited $status after SIGTERM to every rank, expected 0: $(tail -5 "$d/ranks.log")"
  # 3. Without dtprun: two ranks started by hand; each must exit 0.
  master_port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  ranks=()
  for rank in 0 1; do
    RANK=$rank WORLD_SIZE=2 LOCAL_RANK=$rank LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$master_port \
      OMP_NUM_THREADS=1 "$serve" "${flags[@]}" >> "$d/bare.log" 2>&1 &
    ranks+=("$!")
    pids+=("$!")
  done
  hold bare "${ranks[0]}"
  kill -TERM "${ranks[@]}"
  settle bare "${ranks[@]}"
  for rank in 0 1; do
    status=0
    wait "${ranks[$rank]}" || status=$?
    [ "$status" -eq 0 ] || fail "bare: rank $rank exited $status after SIGTERM, expected 0: $(tail -5 "$d/bare.log")"
  done
  pids=()
  echo "serve_test: ok"
  exit 0
fi
if [ "$mode" = --features ]; then
  start feat "$d/chat" --dtype float64 --context 1024 --max-batch 4 --enable-prefix-caching
  grep -q 'prefix caching' "$d/feat.log" || fail "feat: the listening line does not say prefix caching: $(cat "$d/feat.log")"
  node "$here/serve_features_test.mjs" "http://127.0.0.1:$feat_port/v1" "$dtprun" "$reference" "$d" 1024 ||
    fail "feature checks (server log: $(tail -5 "$d/feat.log"))"
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
