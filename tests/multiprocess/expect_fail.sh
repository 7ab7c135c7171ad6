#!/usr/bin/env bash
# Runs a command that must fail, quickly and with a clear message:
#
#   expect_fail.sh [--status N] [--free-port VAR] MAX_SECONDS REGEX COMMAND [ARGS...]
#
# Passes only if COMMAND
#   - exits non-zero (exactly N with --status N),
#   - writes output (stdout and stderr together) that matches REGEX, an
#     extended regex in which '.' also matches newlines, and
#   - finishes within MAX_SECONDS.
# COMMAND runs under `timeout 60`, so a hang fails the test instead of
# stalling CI. --free-port VAR exports VAR set to a TCP port on 127.0.0.1 that
# was free a moment ago (for MASTER_PORT). Core dumps are disabled: ranks that
# die by an uncaught exception abort.
set -u

usage() {
  echo "expect_fail.sh: $1. Usage: expect_fail.sh [--status N] [--free-port VAR] MAX_SECONDS REGEX COMMAND [ARGS...]" >&2
  exit 2
}

want_status=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --status) [[ $# -ge 2 ]] || usage "--status needs a value"; want_status="$2"; shift 2 ;;
    --free-port)
      [[ $# -ge 2 ]] || usage "--free-port needs a variable name"
      port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])') ||
        usage "cannot pick a free port with python3"
      export "$2=$port"
      echo "expect_fail.sh: $2=$port"
      shift 2 ;;
    --) shift; break ;;
    -*) usage "unknown option '$1'" ;;
    *) break ;;
  esac
done
[[ $# -ge 3 ]] || usage "expected MAX_SECONDS, REGEX and a COMMAND"
max_seconds="$1"
regex="$2"
shift 2

ulimit -c 0
start=$(date +%s%N)
output=$(timeout -k 5 60 "$@" 2>&1)
status=$?
elapsed_ms=$((($(date +%s%N) - start) / 1000000))
printf '%s\n' "$output"
echo "expect_fail.sh: '$*' exited with status $status after ${elapsed_ms} ms"

ok=1
if [[ $status -eq 124 || $status -eq 137 ]]; then
  echo "expect_fail.sh: FAIL: the command hung and was killed after 60 s"
  ok=0
elif [[ $status -eq 0 ]]; then
  echo "expect_fail.sh: FAIL: the command succeeded; expected it to fail"
  ok=0
elif [[ -n $want_status && $status -ne $want_status ]]; then
  echo "expect_fail.sh: FAIL: got exit status $status, expected $want_status"
  ok=0
fi
if ! [[ $output =~ $regex ]]; then
  echo "expect_fail.sh: FAIL: the output does not match the regex: $regex"
  ok=0
fi
if ((elapsed_ms > max_seconds * 1000)); then
  echo "expect_fail.sh: FAIL: took ${elapsed_ms} ms, expected at most ${max_seconds} s"
  ok=0
fi
if ((ok)); then
  echo "expect_fail.sh: ok: failed as expected, with the expected message, in time"
  exit 0
fi
exit 1
