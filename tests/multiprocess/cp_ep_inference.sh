#!/usr/bin/env bash
# dtp-generate and dtp-serve with --cp and --ep together (#58): an MoE model
# (4 experts, top 2, float64) on 2 ranks whose experts spread over the cp
# ranks (EP=2 over CP=2) and whose prefill runs over them: greedy
# continuations equal one rank's; the prefill's collectives are those of
# --cp 2 alone plus those of --ep 2 alone (measured on the same prompts):
# the composition adds none; dtp-serve (its KV cache sharded over the cp
# ranks, --cp-kv-cache sharded) answers as one rank, and its /metrics counts
# the prefills that ran over cp.
#   cp_ep_inference.sh DTPRUN DTP-TRAIN DTP-GENERATE DTP-SERVE
set -euo pipefail
dtprun=$1 train=$2 generate=$3 serve=$4
d=$(mktemp -d)
server=""
trap '[ -n "$server" ] && kill -TERM $server 2>/dev/null; wait; rm -rf "$d"' EXIT
fail() { echo "FAILED: $*"; exit 1; }

"$dtprun" -n 1 "$train" --steps 8 --dim 64 --layers 2 --seq 32 --kv-heads 2 --experts 4 --top-k 2 --dtype float64 \
  --save "$d/ck" --log-every 8 > /dev/null
p1="Once upon a time in a land far away"
p2="The quick brown fox jumps"
"$dtprun" -n 1 "$generate" --checkpoint "$d/ck" --tokens 16 --prompt "$p1" --prompt "$p2" 2> /dev/null |
  grep -v "dtp-generate:" > "$d/want"
[ "$(wc -l < "$d/want")" -eq 2 ] || fail "one rank gave $(wc -l < "$d/want") continuations, not 2"

prefill_collectives() {  # FLAGS...: dtp-generate's count of the prefill's collectives on 2 ranks
  "$dtprun" -n 2 "$generate" --checkpoint "$d/ck" --tokens 16 --prompt "$p1" --prompt "$p2" "$@" 2> /dev/null \
    > "$d/got"
  grep -v "dtp-generate:" "$d/got" | diff "$d/want" - > /dev/null || fail "dtp-generate $* differs from one rank"
  sed -n 's/.*: prefill .* ms (\([0-9]*\) collectives).*/\1/p' "$d/got"
}
cp=$(prefill_collectives --cp 2)
ep=$(prefill_collectives --ep 2)
both=$(prefill_collectives --cp 2 --ep 2)
grep -q "EP=2 (over CP=2) x TP=1: prefill" "$d/got" || { cat "$d/got"; fail "dtp-generate names no EP=2 (over CP=2)"; }
[[ -n $cp && -n $ep && $both == $((cp + ep)) ]] ||
  fail "the prefill's collectives: --cp 2 --ep 2 issued '$both', --cp 2 '$cp' and --ep 2 '$ep'"
echo "cp_ep_inference: the prefill's collectives: $cp (cp) + $ep (ep) = $both"
echo "cp_ep_inference: dtp-generate --cp 2 --ep 2 equals one rank"

"$dtprun" -n 2 "$serve" --checkpoint "$d/ck" --cp 2 --ep 2 --cp-kv-cache sharded --port 0 > "$d/serve.log" 2>&1 &
server=$!
for _ in $(seq 1 120); do grep -q "listening on" "$d/serve.log" && break; sleep 0.5; done
url=$(grep -o "http://127.0.0.1:[0-9]*" "$d/serve.log" | head -1)
[ -n "$url" ] || { cat "$d/serve.log"; fail "dtp-serve --cp 2 --ep 2 did not start"; }
grep -q "EP=2 (over CP=2) x TP=1" "$d/serve.log" || { cat "$d/serve.log"; fail "dtp-serve names no EP=2 (over CP=2)"; }
for prompt in "$p1" "$p2" "A"; do
  "$dtprun" -n 1 "$generate" --checkpoint "$d/ck" --tokens 16 --prompt "$prompt" 2> /dev/null |
    grep -v "dtp-generate:" | sed 's/^\[rank 0\] //' > "$d/want1"
  node -e 'fetch(process.argv[1] + "/v1/completions", {method: "POST", headers: {"content-type": "application/json"},
    body: JSON.stringify({prompt: process.argv[2], max_tokens: 16, temperature: 0})})
    .then((r) => r.json()).then((j) => console.log(process.argv[2] + j.choices[0].text))' "$url" "$prompt" > "$d/got1"
  diff "$d/want1" "$d/got1" || fail "dtp-serve --cp 2 --ep 2 differs from one rank on '$prompt'"
done
# One request at a time, each a fresh prompt alone: the two long ones
# prefill over cp, "A" (shorter than 2 x cp positions) as replicas.
prefills=$(node -e 'fetch(process.argv[1] + "/metrics").then((r) => r.text()).then((t) => console.log(
  (t.match(/^dtp_serve_context_parallel_prefills_total (\d+)$/m) || [])[1]))' "$url")
[ "$prefills" = 2 ] || fail "dtp-serve counted '$prefills' prefills over cp, expected 2 (\"$p1\", \"$p2\")"
echo "cp_ep_inference: dtp-serve prefilled $prefills prompts over cp"
echo "cp_ep_inference: ok"
