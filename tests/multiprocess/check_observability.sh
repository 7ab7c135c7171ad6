#!/usr/bin/env bash
# dtp-train's observability on 2 ranks: --metrics writes one JSON line per
# logged step with every field; --profile writes a Chrome trace per rank with
# dtp's spans (NOTE: [Trace spans]): DTensor ops with placements,
# redistributions, collectives with bytes; scripts/plot.sh draws the metrics
# (where gnuplot is installed).
#   check_observability.sh DTPRUN DTP_TRAIN WORKDIR
set -euo pipefail
dtprun=$1 train=$2 dir=$3
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
rm -rf "$dir" && mkdir -p "$dir"
fail() { echo "check_observability: FAILED: $*" >&2; exit 1; }

"$dtprun" -n 2 "$train" --steps 6 --log-every 2 --dim 64 --layers 1 --batch 4 --seq 16 \
  --metrics "$dir/metrics.jsonl" --profile "$dir/trace" --profile-steps 2

lines=$(wc -l < "$dir/metrics.jsonl")
[ "$lines" -eq 3 ] || fail "metrics.jsonl has $lines lines, expected 3 (steps 2, 4, 6)"
for key in step loss tokens_per_s step_ms peak_rss_mib collectives_per_step comm_bytes_per_step grad_norm lr; do
  n=$(grep -c "\"$key\": [0-9.e+-]*[,}]" "$dir/metrics.jsonl" || true)
  [ "$n" -eq 3 ] || fail "\"$key\" is a number on $n of 3 metrics lines"
done
# TP=2 with sequence parallelism: collectives in every step, the same count each step.
per_step=$(grep -o '"collectives_per_step": [0-9.]*' "$dir/metrics.jsonl" | awk '{print $2}' | sort -u)
[ "$(echo "$per_step" | wc -l)" -eq 1 ] && [ "${per_step%.*}" -gt 0 ] ||
  fail "collectives_per_step should be one positive figure over the run, got: $per_step"
echo "metrics: 3 lines, every field a number, $per_step collectives per step"

# A MoE model at (dp, tp) = (2, 1): the routed slots per expert of each
# logged step sum to batch * seq * top_k * layers (every token, both dp
# halves, counted), and the load-balancing loss is a positive number.
"$dtprun" -n 2 "$train" --steps 4 --log-every 2 --dim 32 --layers 2 --batch 4 --seq 16 --dp 2 --experts 4 --top-k 2 \
  --aux-loss-coef 0.05 --metrics "$dir/moe.jsonl" >/dev/null
while read -r line; do
  sum=$(grep -o '"tokens_per_expert": \[[0-9, ]*\]' <<<"$line" | grep -o '[0-9]*' | awk '{s += $1} END {print s + 0}')
  [ "$sum" -eq $((4 * 16 * 2 * 2)) ] || fail "tokens_per_expert sums to $sum, expected $((4 * 16 * 2 * 2)): $line"
  grep -q '"aux_loss": [0-9.e+-]*[,}]' <<<"$line" || fail "no aux_loss number: $line"
done < "$dir/moe.jsonl"
[ "$(wc -l < "$dir/moe.jsonl")" -eq 2 ] || fail "moe.jsonl has $(wc -l < "$dir/moe.jsonl") lines, expected 2"
echo "moe metrics: tokens per expert sum to batch x seq x top_k x layers, aux loss reported"

for rank in 0 1; do
  trace="$dir/trace/rank$rank.json"
  [ -s "$trace" ] || fail "$trace is missing"
  grep -q 'DTensor fused aten::linear (' "$trace" || fail "no DTensor fused aten::linear span in $trace"
  grep -q 'DTensor aten::[a-z_.]* (S(1)' "$trace" || fail "no DTensor op span with an S(1) input in $trace"
  grep -q 'redistribute f32\[' "$trace" || fail "no redistribute span in $trace"
  grep -q 'all_gather [0-9]* B over ranks \[0, 1\]' "$trace" || fail "no all_gather span with bytes in $trace"
  grep -q 'reduce_scatter [0-9]* B over ranks \[0, 1\]' "$trace" || fail "no reduce_scatter span with bytes in $trace"
done
echo "trace: per rank, DTensor op spans with placements, redistributions, collectives with bytes"
grep -o '"DTensor fused [^"]*"' "$dir/trace/rank0.json" | sort | uniq -c | head -3

if command -v gnuplot >/dev/null; then
  "$here/../../scripts/plot.sh" "$dir/metrics.jsonl" "$dir/metrics.png"
  [ -s "$dir/metrics.png" ] || fail "plot.sh wrote no PNG"
  echo "plot: $(stat -c %s "$dir/metrics.png") bytes"
else
  echo "plot: not checked here (no gnuplot; scripts/plot.sh installs it when run)"
fi
echo "observability ok"
