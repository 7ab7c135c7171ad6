#!/usr/bin/env bash
# dtp-generate --chat end to end on a tiny Hugging Face folder: dtp-train
# exports a model (vocab 256), tiny-chatml/ gives it a tokenizer.json (38 ids)
# and a ChatML template; then
# - --chat/--system formats, encodes the special tokens as their ids (the
#   prompt is 38 tokens, not the ~100 of its characters) and stops at
#   <|im_end|> (37), and at generation_config.json's eos_token_id list too;
# - a template of no known family, and --chat with a tokenizer that is not a
#   tokenizer.json, are refused by name.
#   chat_generate.sh DTPRUN DTP_TRAIN DTP_GENERATE FIXTURE_DIR
set -euo pipefail
dtprun=$1 train=$2 generate=$3 fixture=$4
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
fail() { echo "chat_generate: FAILED: $*"; exit 1; }

"$dtprun" -n 1 "$train" --steps 1 --dim 32 --seq 16 --save-hf "$d/hf" > /dev/null
cp "$fixture"/tokenizer.json "$fixture"/tokenizer_config.json "$d/hf/"
chat=(--hf "$d/hf" --chat "hi" --system "be brief" --tokens 4 --context 64)

"$dtprun" -n 2 "$generate" "${chat[@]}" > "$d/out" 2>&1 || fail "$(cat "$d/out")"
grep -q "chat: ChatML template of $d/hf/tokenizer_config.json, prompt 38 tokens, stops at \[37\]" "$d/out" ||
  fail "format: $(cat "$d/out")"
grep -q "dtp-generate: 1 prompt(s), TP=2" "$d/out" || fail "generate: $(cat "$d/out")"

echo '{"eos_token_id": [35, 36]}' > "$d/hf/generation_config.json"
"$dtprun" -n 1 "$generate" "${chat[@]}" > "$d/out" 2>&1 || fail "$(cat "$d/out")"
grep -q "stops at \[35, 36, 37\]" "$d/out" || fail "end tokens: $(cat "$d/out")"

if "$dtprun" -n 1 "$generate" "${chat[@]}" --tokenizer byte > "$d/out" 2>&1; then fail "--chat with bytes ran"; fi
grep -q "\-\-chat needs a Hugging Face tokenizer.json: got the tokenizer byte" "$d/out" || fail "bytes: $(cat "$d/out")"

echo '{"eos_token": "<|im_end|>", "chat_template": "{% for m in messages %}<start_of_turn>{{ m.content }}<end_of_turn>{% endfor %}"}' \
  > "$d/hf/tokenizer_config.json"
if "$dtprun" -n 1 "$generate" "${chat[@]}" > "$d/out" 2>&1; then fail "an unknown template ran"; fi
grep -q "unsupported chat template in '$d/hf/tokenizer_config.json': got a template without the markers" "$d/out" ||
  fail "template: $(cat "$d/out")"
echo "chat_generate: ok"
