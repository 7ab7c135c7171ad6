#!/usr/bin/env bash
# Draws a dtp-train --metrics file (JSON Lines) as a PNG: loss and tokens/s
# against the step. Installs gnuplot (Debian's gnuplot-nox) when missing.
#
#   scripts/plot.sh metrics.jsonl [out.png]     # default: metrics.png beside it
set -euo pipefail
in=${1:?usage: scripts/plot.sh METRICS.jsonl [OUT.png]}
out=${2:-${in%.*}.png}
[ -s "$in" ] || { echo "plot: $in is missing or empty: write it with dtp-train --metrics $in" >&2; exit 1; }
if ! command -v gnuplot >/dev/null; then
  echo "plot: installing gnuplot-nox"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  apt=($sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600)
  "${apt[@]}" update -qq
  "${apt[@]}" install -y -qq --no-install-recommends gnuplot-nox
fi

# The flat JSON objects dtp-train writes, as columns: step loss tokens/s step_ms.
data=$(mktemp)
trap 'rm -f "$data"' EXIT
awk '{
  delete v
  line = $0
  gsub(/[{}" ]/, "", line)
  n = split(line, fields, ",")
  for (i = 1; i <= n; i++) { split(fields[i], kv, ":"); v[kv[1]] = kv[2] }
  if (!("step" in v) || !("loss" in v) || !("tokens_per_s" in v)) {
    printf "plot: line %d of %s is not a dtp-train --metrics line\n", NR, FILENAME > "/dev/stderr"; exit 1
  }
  print v["step"], (v["loss"] == "null" ? "NaN" : v["loss"]), v["tokens_per_s"], v["step_ms"]
}' "$in" > "$data"

gnuplot <<GNUPLOT
set terminal pngcairo size 1100,420 font "sans,10"
set output "$out"
set multiplot layout 1,2 title "dtp-train: $(basename "$in")"
set grid
set xlabel "step"
set ylabel "loss"
set key off
plot "$data" using 1:2 with linespoints pt 7 ps 0.5 lw 2 lc rgb "#1f77b4"
set ylabel "tokens/s (all ranks)"
set yrange [0:*]
plot "$data" using 1:3 with linespoints pt 7 ps 0.5 lw 2 lc rgb "#d62728"
unset multiplot
GNUPLOT
echo "plot: $out"
