#!/usr/bin/env bash
# dtp-serve's chat page (/) in headless Chromium, driven by playwright-core
# (chat_page_test.mjs):
#   chat_page_test.sh DTPRUN DTP_TRAIN DTP_SERVE TINY_CHATML NPM_CACHE OUT_DIR
# - dtp-train exports a tiny model (as serve_test.sh), with the tiny-chatml
#   tokenizer and ChatML template; dtprun -n 2 dtp-serve --port 0 serves it;
# - the page is typed into and its streamed replies are compared with the
#   API's greedy answers to the same chats; screenshots go to
#   OUT_DIR/chat_page.png and OUT_DIR/chat_page_error.png.
# Skips (exit 77, "chat_page_test: SKIP") without Debian's chromium
# (apt install chromium) or when npm cannot install playwright-core.
set -euo pipefail
dtprun=$1 train=$2 serve=$3 chatml=$4
cache=$(mkdir -p "$5" && realpath "$5")
out=$(mkdir -p "$6" && realpath "$6")
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
fail() { echo "chat_page_test: FAILED: $*"; exit 1; }
skip() { echo "chat_page_test: SKIP: $*"; exit 77; }

chromium=${DTP_CHROMIUM:-/usr/bin/chromium}
[ -x "$chromium" ] || skip "no $chromium (Debian: apt install chromium; or set DTP_CHROMIUM)"

package=playwright-core@1.65.1
exec 9> "$cache/.install.lock"
flock 9
if [ ! -e "$cache/installed-$package" ]; then
  [ -f "$cache/package.json" ] || echo '{"private": true}' > "$cache/package.json"
  # PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD: the test runs Debian's chromium, never a downloaded one.
  if ! PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 timeout 300 npm install --prefix "$cache" --no-audit --no-fund \
       --ignore-scripts --loglevel=error "$package"; then
    skip "npm could not install $package (offline?)"
  fi
  touch "$cache/installed-$package"
fi
flock -u 9

d=$(mktemp -d)
pid=""
cleanup() {
  if [ -n "$pid" ]; then  # dtprun passes SIGTERM to the ranks; they stop within seconds
    kill -TERM "$pid" 2>/dev/null || true
    timeout 10 tail --pid="$pid" -f /dev/null || kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -rf "$d"
}
trap cleanup EXIT

"$dtprun" -n 1 "$train" --steps 100 --dim 32 --seq 32 --save-hf "$d/chat" > "$d/train.log" 2>&1 || fail "$(cat "$d/train.log")"
cp "$chatml/tokenizer.json" "$chatml/tokenizer_config.json" "$d/chat/"

"$dtprun" -n 2 "$serve" --hf "$d/chat" --port 0 --context 256 --max-batch 4 > "$d/serve.log" 2>&1 &
pid=$!
port=""
for _ in $(seq 1 600); do
  port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$d/serve.log" | grep -o '[0-9]*$' || true)
  [ -n "$port" ] && break
  kill -0 "$pid" 2>/dev/null || fail "server exited: $(cat "$d/serve.log")"
  sleep 0.1
done
[ -n "$port" ] || fail "server not listening after 60 s: $(cat "$d/serve.log")"

mkdir "$d/profile"  # a fresh --user-data-dir
DTP_NPM_PREFIX="$cache" timeout 300 node "$here/chat_page_test.mjs" "http://127.0.0.1:$port/" "$chromium" "$d/profile" "$out" ||
  fail "page checks (server log: $(tail -5 "$d/serve.log"))"
echo "chat_page_test: ok (screenshots in $out)"
