#!/usr/bin/env bash
# The main job: install what is missing, build, run dtp-train on 2 ranks, and
# draw its loss and throughput (scripts/plot.sh) to $build/main-train.png from
# the metrics it wrote to $build/main-metrics.jsonl. Extra arguments go to
# dtp-train.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build=${DTP_BUILD_DIR:-build}
scripts/setup.sh dtprun dtp-train
args=("$@")
[[ " $* " == *" --metrics"* ]] || args+=(--metrics "$build/main-metrics.jsonl")
[[ " $* " == *" --log-every"* ]] || args+=(--log-every 10)
"$build/apps/dtprun/dtprun" -n 2 "$build/apps/dtp-train" "${args[@]}"
[[ " $* " == *" --metrics"* ]] || scripts/plot.sh "$build/main-metrics.jsonl" "$build/main-train.png"
