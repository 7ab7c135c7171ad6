#!/usr/bin/env bash
# The Hugging Face interop test: dtp against Python, one process per rank.
#
#   tests/hf/run_hf_check.sh BUILD_DIR WORKDIR
#
# For each case below (a family and its switches, NOTE: [Model families]):
# make_tiny_llama.py writes a random HF folder, llama_reference.py its
# reference logits on 2 sequences of 12 tokens and their greedy continuation;
# then at each layout hf_check computes them and compare_logits.py checks
# them:
#   -n 1, -n 2 (tp 2), -n 4 (tp 4, when kv-heads % 4 == 0): logits and the
#     greedy KV-cache continuation (inference plan), and the export;
#   -n 4 --dp 2 (dp 2 x tp 2, FSDP), the same with --ddp: logits and export;
#   -n 2 --pp 2, -n 4 --pp 2 (pp 2 x tp 2): a GPipe pipeline's loss (untied
#     folders: tied embeddings across stages are NYI);
#   MoE folders: the load-balancing loss, and logits under expert
#     parallelism at ep 2 and 4, (ep, tp) = (2, 2) and (dp, ep) = (2, 2) FSDP.
# compare_export.py checks each export against the original files (both run
# for every layout of a folder in one process, compare_layouts.py). Folders
# with a vocabulary of 256 are also fine-tuned by dtp-train --init-from-hf at
# (dp, tp) = (2, 2), MoE folders at (dp, ep) = (2, 2) and (ep, tp) = (2, 2),
# with --check-parity (equal to one device in float64). One
# summary line per case and layout; the last line is "hf interop ok" only
# when every check held, and the exit status is non-zero otherwise. Each
# step's full output is in WORKDIR/<case>/*.log.
#
# hf_check and dtprun are found in BUILD_DIR (tests/hf/hf_check,
# apps/dtprun/dtprun, apps/dtp-train) unless HF_CHECK, DTPRUN and DTP_TRAIN name
# them; PYTHON (default
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
dtp_train=${DTP_TRAIN:-$build/apps/dtp-train}
python=${PYTHON:-python3}
export PYTHONDONTWRITEBYTECODE=1  # no __pycache__ in the source tree
for tool in "$hf_check" "$dtprun" "$dtp_train"; do
  if [[ ! -x $tool ]]; then
    echo "run_hf_check: no executable $tool. Build the targets hf_check, dtprun and dtp-train in $build." >&2
    exit 2
  fi
done

# name|make_tiny_llama.py options (kv-heads decides the layouts).
cases=(
  "gqa_f32_untied|--seed 1 --heads 8 --kv-heads 2 --hidden 64 --intermediate 160 --vocab 96 --layers 2 --dtype float32 --shards 3"
  "tied_bf16|--seed 2 --heads 4 --kv-heads 4 --hidden 32 --tied --dtype bfloat16 --shards 1"
  "untied_f16|--seed 3 --heads 4 --kv-heads 4 --dtype float16 --shards 2"
  "llama3_rope_tied|--vocab 256 --family llama --rope-llama3 8,1,4,32 --seed 4 --heads 4 --kv-heads 4 --hidden 64 --tied --dtype bfloat16"
  "llama_attention_bias|--vocab 256 --family llama --attention-bias --seed 5 --heads 4 --kv-heads 2 --hidden 32 --shards 2"
  "mistral_window5|--vocab 256 --family mistral --sliding-window 5 --seed 6 --heads 8 --kv-heads 4 --hidden 64 --shards 2"
  "qwen2_tied_bf16|--vocab 256 --family qwen2 --tied --seed 7 --heads 4 --kv-heads 2 --hidden 32 --dtype bfloat16"
  "qwen2_untied|--vocab 256 --family qwen2 --seed 9 --heads 8 --kv-heads 4 --hidden 64 --shards 3"
  "mixtral_e4_window5|--vocab 256 --family mixtral --experts 4 --top-k 2 --sliding-window 5 --seed 10 --heads 4 --kv-heads 2 --hidden 32 --shards 2"
  "qwen3_moe_e8_norm|--vocab 256 --family qwen3_moe --experts 8 --top-k 2 --norm-topk-prob --head-dim 16 --seed 11 --heads 4 --kv-heads 4 --hidden 32"
  "qwen3_moe_e4|--vocab 256 --family qwen3_moe --experts 4 --top-k 3 --seed 12 --heads 4 --kv-heads 2 --hidden 32 --dtype bfloat16"
  "qwen2_moe_e4_shared|--vocab 256 --family qwen2_moe --experts 4 --top-k 2 --shared-intermediate 40 --seed 13 --heads 4 --kv-heads 2 --hidden 32 --shards 2"
  "qwen3_head_dim16|--vocab 256 --family qwen3 --head-dim 16 --seed 8 --heads 4 --kv-heads 4 --hidden 32 --shards 2"
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

# One case (a folder and all its layouts): its summary lines on stdout, and
# its failures and checks in the callers' counters.
run_case() {
  local c=$1 name make_args dir model ref kv_heads moe layouts jobs results vocab train_layouts layout line where
  local n flags expect flag_args tag out export_dir start exported
  name=${c%%|*}
  read -r -a make_args <<<"${c#*|}"
  dir=$work/$name
  model=$dir/model
  ref=$dir/reference.safetensors
  if ! step "$dir/make.log" "$python" "$here/make_tiny_llama.py" "$model" "${make_args[@]}" ||
     ! step "$dir/reference.log" "$python" "$here/llama_reference.py" "$model" --tokens "$tokens" --greedy 6 \
         --out "$ref" >/dev/null; then
    echo "$name: FAILED to make the folder or its reference"
    failures=$((failures + 1))
    return
  fi
  kv_heads=$("$python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["num_key_value_heads"])' "$model/config.json")

  moe=0
  grep -q '"num_experts_per_tok"' "$model/config.json" && moe=1
  # ranks|hf_check flags|what compare_logits.py checks
  layouts=("1|--greedy 6|logits,greedy" "2|--greedy 6|logits,greedy")
  ((kv_heads % 4 == 0)) && layouts+=("4|--greedy 6|logits,greedy")
  layouts+=("4|--dp 2|logits")
  # DDP loads as TP does and replicates: once for a dense folder and the MoE ones (CI time).
  [[ $name == gqa_f32_untied ]] || ((moe)) && layouts+=("4|--dp 2 --ddp|logits")
  if ((moe)); then  # the load-balancing loss too, and expert parallelism at ep 2 and 4, (ep, tp) and (dp, ep)
    layouts=("${layouts[@]/%|logits/|logits,aux}")
    layouts=("${layouts[@]/%|logits,greedy/|logits,greedy,aux}")
    layouts+=("2|--ep|logits" "4|--ep|logits" "4|--ep --tp 2|logits" "4|--ep --dp 2|logits")
  fi
  # Tied embeddings across pipeline stages are NYI (llama_pipeline_stage says so).
  grep -q '"tie_word_embeddings": true' "$model/config.json" || layouts+=("2|--pp 2|loss" "4|--pp 2|loss")
  # hf_check at every layout, then one python process compares them all
  # (compare_layouts.py: importing torch took 2.7 s a process, twice per
  # layout before).
  jobs=$dir/compare_jobs.tsv
  : > "$jobs"
  declare -A where_of=() seconds_of=() files_of=()
  for layout in "${layouts[@]}"; do
    IFS='|' read -r n flags expect <<<"$layout"
    read -r -a flag_args <<<"$flags"
    tag="n${n}$(tr -d ' -' <<<"$flags")"
    where="$name -n $n $flags"
    out=$dir/got_$tag.safetensors
    export_dir=$dir/export_$tag
    checks=$((checks + 1))
    start=$SECONDS
    if ! step "$dir/hf_check_$tag.log" "$dtprun" -n "$n" "$hf_check" "$model" "$ref" "$out" "$export_dir" "${flag_args[@]}" >/dev/null; then
      echo "$where: FAILED (hf_check)"
      failures=$((failures + 1))
      continue
    fi
    where_of[$tag]=$where
    seconds_of[$tag]=$((SECONDS - start))
    exported=-
    if [[ $expect != loss ]]; then
      exported=$export_dir
      files_of[$tag]=$(find "$export_dir" -name '*.safetensors' | wc -l)
    fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$tag" "$ref" "$out" "$expect" "$model" "$exported" >> "$jobs"
  done
  results=$dir/compare_results.tsv
  if ! step "$dir/compare.log" "$python" "$here/compare_layouts.py" "$jobs" "$results" >/dev/null; then
    echo "$name: FAILED to compare the layouts (compare_layouts.py)"
    failures=$((failures + $(wc -l < "$jobs")))
  else
    while IFS=$'\t' read -r tag verdict got export; do
      [[ -n ${files_of[$tag]:-} ]] && export="$export in ${files_of[$tag]} files"
      if [[ $verdict == ok ]]; then
        echo "${where_of[$tag]}: $got; $export (${seconds_of[$tag]} s)"
      else
        echo "${where_of[$tag]}: FAILED: $got; $export"
        failures=$((failures + 1))
      fi
    done < "$results"
    if (($(wc -l < "$results") != $(wc -l < "$jobs"))); then
      echo "$name: FAILED: $(wc -l < "$results") comparisons for $(wc -l < "$jobs") layouts"
      failures=$((failures + 1))
    fi
  fi

  # Fine-tuning through the app: (dp, tp) = (2, 2) FSDP against one device in
  # float64, on the folders whose vocabulary holds dtp-train's byte tokens;
  # MoE folders with expert parallelism instead: (dp, ep) = (2, 2) and
  # (ep, tp) = (2, 2), FSDP over dp x ep (each rank loads its experts).
  vocab=$("$python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$model/config.json")
  train_layouts=("--dp 2")
  ((moe)) && train_layouts=("--dp 2 --ep 2 --tp 1" "--ep 2 --tp 2")
  for layout in "${train_layouts[@]}"; do
    ((vocab >= 256)) || break
    checks=$((checks + 1))
    where="$name dtp-train -n 4 $layout --init-from-hf"
    line=""
    # shellcheck disable=SC2086 # the layout's flags
    if step "$dir/train.log" "$dtprun" -n 4 "$dtp_train" --init-from-hf "$model" $layout --steps 3 --seq 8 \
         --batch 4 --dtype float64 --check-parity >/dev/null &&
       line=$(grep -m1 "parity vs one device" "$dir/train.log") && grep -q "in float64 .*: ok" <<<"$line"; then
      echo "$where: $line"
    else
      echo "$where: FAILED: ${line:-see above}"
      failures=$((failures + 1))
    fi
  done
}

# Two cases at once: one case keeps 1.1 of 2 cores busy (177 s wall, 202 s of
# CPU one after another, Debian 13, 2026-12-07); their lines are printed in
# order.
names=()
for c in "${cases[@]}"; do
  name=${c%%|*}
  rm -rf "${work:?}/$name"
  mkdir -p "$work/$name"
  while (($(jobs -rp | wc -l) >= 2)); do wait -n || true; done
  (failures=0 checks=0; run_case "$c"; echo "$checks $failures" > "$work/$name/counts") > "$work/$name/summary.log" 2>&1 &
  names+=("$name")
done
wait
for name in "${names[@]}"; do
  cat "$work/$name/summary.log"
  if read -r case_checks case_failures < "$work/$name/counts"; then
    checks=$((checks + case_checks)) failures=$((failures + case_failures))
  else
    echo "$name: FAILED: its run ended early (see above)"
    failures=$((failures + 1))
  fi
done

if ((failures)); then
  echo "hf interop FAILED: $failures failure(s) in $checks layouts of ${#cases[@]} folders"
  exit 1
fi
echo "hf interop ok"
