#!/usr/bin/env bash
# dtp-train's and dtp-generate's checkpoint folders end to end, from a folder
# holding the user's files (NOTE: [Nothing dtp did not write]):
# - --save DIR writes DIR/step-<N>/, --keep-last removes only older steps;
# - a save killed mid-way is skipped by --resume DIR, with a line, and the
#   losses continue as the uninterrupted run's (float64, 4 decimals): once
#   with the leftover made by hand (step-5.incomplete: a marker, a cut rank
#   file), once with both ranks SIGKILLed while saving every step;
# - the user's files survive byte for byte; refused saves leave no entry;
# - dtp-generate --checkpoint DIR needs no size flags; one that contradicts
#   the recorded config is an error naming both values;
# - the older flat layout still resumes, and --save onto it is refused;
# - --save-hf into a folder with the user's README and tokenizer keeps them.
# Usage: train_checkpoints.sh DTPRUN DTP-TRAIN DTP-GENERATE
set -euo pipefail
export LC_ALL=C
dtprun=$1 train=$2 generate=$3
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
common="--dim 32 --seq 16 --kv-heads 2 --layers 2 --dtype float64 --log-every 1"
losses() { grep -E '^\[rank 0\] step +[0-9]+  loss' | sed 's/ *[0-9.]* tok.*//'; }
fail() { echo "train_checkpoints: FAILED: $*"; exit 1; }

"$dtprun" -n 2 "$train" $common --steps 8 | losses > "$d/want"
[ "$(wc -l < "$d/want")" = 8 ] || fail "expected 8 loss lines, got: $(cat "$d/want")"

mkdir -p "$d/exp/runs"
echo "my notes" > "$d/exp/notes.txt"
echo "step,loss" > "$d/exp/runs/r1.csv"
sums() { (cd "$d/exp" && sha256sum notes.txt runs/r1.csv); }
sums > "$d/user.sums"

"$dtprun" -n 2 "$train" $common --steps 4 --save "$d/exp" --save-every 1 --keep-last 2 > "$d/a.log"
[ "$(ls "$d/exp" | tr '\n' ' ')" = "notes.txt runs step-3 step-4 " ] || fail "after --keep-last 2: $(ls "$d/exp")"
grep -q "removed the older checkpoint $d/exp/step-1 (--keep-last 2)" "$d/a.log" || fail "no line for the removed step-1"
echo "saved: $(ls "$d/exp" | tr '\n' ' ')"

# What a save of step 5 killed mid-way leaves behind.
cp -r "$d/exp/step-4" "$d/exp/step-5.incomplete"
rm "$d/exp/step-5.incomplete/index.json"
echo "pid 1 on elsewhere" > "$d/exp/step-5.incomplete/.dtp-writing"
truncate -s 100 "$d/exp/step-5.incomplete/rank-00001.safetensors"

"$dtprun" -n 2 "$train" $common --steps 8 --resume "$d/exp" --save "$d/exp" --save-every 1 --keep-last 2 > "$d/b.log"
grep -q "skipping '$d/exp/step-5.incomplete': a save that did not finish" "$d/b.log" || fail "no skip line"
grep -q "resuming from $d/exp/step-4" "$d/b.log" || fail "did not resume from step-4"
losses < "$d/b.log" > "$d/got"
[ "$(wc -l < "$d/got")" = 4 ] || fail "expected the losses of steps 5-8, got: $(cat "$d/got")"
diff <(grep -E 'step +[5-8] ' "$d/want") "$d/got" || fail "resumed losses differ"
echo "resumed from step-4 past a killed save: steps 5-8 equal the uninterrupted run"
[ "$(ls "$d/exp" | tr '\n' ' ')" = "notes.txt runs step-7 step-8 " ] || fail "after the resumed run: $(ls "$d/exp")"
sums | diff "$d/user.sums" - || fail "the user's files changed"
echo "the user's files are intact"

# A real kill: both ranks SIGKILLed while the job saves every step in the
# background (a save is in flight nearly all the time). --resume takes the
# newest complete step N, says which unfinished one it skipped (when the kill
# left one newer), and steps N+1..N+3 equal an uninterrupted run's.
"$dtprun" -n 2 "$train" $common --steps 100000 --save "$d/kill" --save-every 1 > "$d/k.log" 2>&1 &
job=$!
for _ in $(seq 1 600); do [ -d "$d/kill/step-3" ] && break; sleep 0.05; done
pkill -9 -P "$job" || true
wait "$job" 2>/dev/null || true
newest=$(ls "$d/kill" | sed -n 's/^step-\([0-9]*\)$/\1/p' | sort -n | tail -1)
unfinished=$(ls "$d/kill" | sed -n 's/^step-\([0-9]*\)\.incomplete$/\1/p' | sort -n | tail -1)
[ -n "$newest" ] || fail "killed run: no complete step folder: $(ls "$d/kill")"
end=$((newest + 3))
"$dtprun" -n 2 "$train" $common --steps "$end" | losses | tail -n 3 > "$d/wantk"
"$dtprun" -n 2 "$train" $common --steps "$end" --resume "$d/kill" > "$d/kr.log"
grep -q "resuming from $d/kill/step-$newest" "$d/kr.log" || fail "did not resume from step-$newest: $(head -3 "$d/kr.log")"
if [ -n "$unfinished" ] && [ "$unfinished" -gt "$newest" ]; then
  grep -q "skipping '$d/kill/step-$unfinished.incomplete': a save that did not finish" "$d/kr.log" || fail "no skip line"
fi
losses < "$d/kr.log" > "$d/gotk"
[ "$(wc -l < "$d/gotk")" = 3 ] && diff "$d/wantk" "$d/gotk" || fail "losses after the kill differ: $(cat "$d/gotk")"
echo "killed at step-${unfinished:-none} in flight: resumed from step-$newest with the uninterrupted losses"

# One step folder by name.
"$dtprun" -n 2 "$train" $common --steps 8 --resume "$d/exp/step-7" | losses > "$d/got7"
[ -s "$d/got7" ] && diff <(grep -E 'step +8 ' "$d/want") "$d/got7" || fail "resume from step-7 differs"

# dtp-generate from the folder alone; a contradicting flag is named.
"$dtprun" -n 2 "$generate" --checkpoint "$d/exp" --prompt "The " --tokens 4 > "$d/gen.log"
grep -q "dtp-generate: 1 prompt(s), TP=2" "$d/gen.log" || fail "dtp-generate --checkpoint DIR"
if "$dtprun" -n 2 "$generate" --checkpoint "$d/exp" --dim 64 --tokens 4 > "$d/gen2.log" 2>&1; then fail "--dim 64 was accepted"; fi
grep -q -- "--dim 64 contradicts the checkpoint '$d/exp/step-8', saved with dim 32" "$d/gen2.log" || fail "$(cat "$d/gen2.log")"
echo "dtp-generate: the folder alone works; --dim 64 is named against dim 32"

# Refused saves leave nothing behind.
before=$(ls -a "$d/exp")
if "$dtprun" -n 2 "$train" $common --steps 1 --save "$d/exp/notes.txt" > "$d/c.log" 2>&1; then fail "--save onto a file"; fi
[ "$before" = "$(ls -a "$d/exp")" ] || fail "a refused save left entries: $(ls -a "$d/exp")"
sums | diff "$d/user.sums" - || fail "the user's files changed"

# The older flat layout: resumes; --save onto it is refused.
cp -r "$d/exp/step-7" "$d/flat"
"$dtprun" -n 2 "$train" $common --steps 8 --resume "$d/flat" | losses > "$d/gotflat"
[ -s "$d/gotflat" ] && diff <(grep -E 'step +8 ' "$d/want") "$d/gotflat" || fail "flat resume differs"
if "$dtprun" -n 2 "$train" $common --steps 1 --save "$d/flat" > "$d/e.log" 2>&1; then fail "--save onto a flat checkpoint"; fi
grep -q "is a checkpoint of the older flat layout" "$d/e.log" || fail "$(cat "$d/e.log")"

# A Hugging Face export into the user's model folder.
mkdir -p "$d/hf"
echo "# my model" > "$d/hf/README.md"
echo '{"mine": true}' > "$d/hf/tokenizer.json"
"$dtprun" -n 2 "$train" $common --steps 1 --save-hf "$d/hf" > /dev/null
"$dtprun" -n 2 "$train" $common --steps 1 --save-hf "$d/hf" > /dev/null
[ "$(ls "$d/hf" | tr '\n' ' ')" = "README.md config.json model.safetensors tokenizer.json " ] || fail "hf: $(ls "$d/hf")"
[ "$(cat "$d/hf/README.md")" = "# my model" ] && [ "$(cat "$d/hf/tokenizer.json")" = '{"mine": true}' ] || fail "hf files changed"
echo "train_checkpoints: ok"
