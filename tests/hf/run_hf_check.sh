#!/usr/bin/env bash
# The Hugging Face interop test: dtp against Python, one process per rank.
#
#   tests/hf/run_hf_check.sh BUILD_DIR WORKDIR
#
# For each case below: make_tiny_llama.py writes a random HF folder,
# llama_reference.py its reference logits on 2 sequences of 12 tokens; then at
# each layout the heads allow (dtprun -n 1; -n 2 (tp 2); -n 4 (tp 4) when
# kv-heads % 4 == 0; -n 4 --dp 2 (dp 2 x tp 2, FSDP)) hf_check computes the
# logits and exports the model, compare_logits.py checks the logits and
# compare_export.py the export. One summary line per case and layout; the last
# line is "hf interop ok" only when every check held, and the exit status is
# non-zero otherwise. Each step's full output is in WORKDIR/<case>/*.log.
#
# hf_check and dtprun are found in BUILD_DIR (tests/hf/hf_check,
# apps/dtprun/dtprun) unless HF_CHECK and DTPRUN name them; PYTHON (default
# python3) must have torch and safetensors.
set -euo pipefail

if [[ $# -ne 2 ]]; then
  echo "run_hf_check: got $# arguments, expected 2. Usage: run_hf_check.sh BUILD_DIR WORKDIR" >&2
  exit 2
fi
build=$1
work=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
hf_check=${HF_CHECK:-$build/tests/hf/hf_check}
dtprun=${DTPRUN:-$build/apps/dtprun/dtprun}
python=${PYTHON:-python3}
export PYTHONDONTWRITEBYTECODE=1  # no __pycache__ in the source tree
for tool in "$hf_check" "$dtprun"; do
  if [[ ! -x $tool ]]; then
    echo "run_hf_check: no executable $tool. Build the targets hf_check and dtprun in $build." >&2
    exit 2
  fi
done

# name|make_tiny_llama.py options (kv-heads decides the layouts).
cases=(
  "gqa_f32_untied|--seed 1 --heads 8 --kv-heads 2 --hidden 64 --intermediate 160 --vocab 96 --layers 2 --dtype float32 --shards 3"
  "tied_bf16|--seed 2 --heads 4 --kv-heads 4 --hidden 32 --tied --dtype bfloat16 --shards 1"
  "untied_f16|--seed 3 --heads 4 --kv-heads 4 --dtype float16 --shards 2"
)
# Token ids < 96, the vocabulary of every case.
tokens="1,17,33,5,90,64,2,48,77,12,95,30;4,4,8,61,23,0,88,15,42,70,9,56"

failures=0
checks=0

# Runs a step with its output in a log; on failure prints the log and counts it.
# Prints the step's last output line (its figures) on success.
step() {
  local log=$1
  shift
  if "$@" >"$log" 2>&1; then
    tail -n 1 "$log"
    return 0
  fi
  echo "FAILED: $*" >&2
  sed 's/^/    /' "$log" >&2
  return 1
}

for c in "${cases[@]}"; do
  name=${c%%|*}
  read -r -a make_args <<<"${c#*|}"
  dir=$work/$name
  rm -rf "$dir"
  mkdir -p "$dir"
  model=$dir/model
  ref=$dir/reference.safetensors
  if ! step "$dir/make.log" "$python" "$here/make_tiny_llama.py" "$model" "${make_args[@]}" ||
     ! step "$dir/reference.log" "$python" "$here/llama_reference.py" "$model" --tokens "$tokens" --out "$ref" >/dev/null; then
    echo "$name: FAILED to make the folder or its reference"
    failures=$((failures + 1))
    continue
  fi
  kv_heads=$("$python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["num_key_value_heads"])' "$model/config.json")

  layouts=("1 1" "2 1")
  ((kv_heads % 4 == 0)) && layouts+=("4 1")
  layouts+=("4 2")
  for layout in "${layouts[@]}"; do
    read -r n dp <<<"$layout"
    tag="n${n}_dp${dp}"
    where="$name -n $n (dp $dp, tp $((n / dp)))"
    out=$dir/logits_$tag.safetensors
    export_dir=$dir/export_$tag
    checks=$((checks + 1))
    start=$SECONDS
    if ! step "$dir/hf_check_$tag.log" "$dtprun" -n "$n" "$hf_check" "$model" "$ref" "$out" "$export_dir" --dp "$dp" >/dev/null; then
      echo "$where: FAILED (hf_check)"
      failures=$((failures + 1))
      continue
    fi
    files=$(find "$export_dir" -name '*.safetensors' | wc -l)
    ok=1
    logits=$(step "$dir/compare_logits_$tag.log" "$python" "$here/compare_logits.py" "$ref" "$out") || ok=0
    export=$(step "$dir/compare_export_$tag.log" "$python" "$here/compare_export.py" "$model" "$export_dir") || ok=0
    seconds=$((SECONDS - start))
    if ((ok)); then
      echo "$where: $logits; $export in $files files (${seconds} s)"
    else
      echo "$where: FAILED: ${logits:-logits differ (see above)}; ${export:-export differs (see above)}"
      failures=$((failures + 1))
    fi
  done
done

if ((failures)); then
  echo "hf interop FAILED: $failures failure(s) in $checks layouts of ${#cases[@]} folders"
  exit 1
fi
echo "hf interop ok"
