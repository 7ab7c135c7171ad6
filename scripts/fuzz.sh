#!/usr/bin/env bash
# Fuzzes the safetensors reader (fuzz/safetensors_fuzz.cpp) with libFuzzer
# under AddressSanitizer and UBSan for SECONDS (default 60), starting from
# fuzz/corpus. Installs clang and its fuzzer runtime from Debian's packages
# when missing; builds in ${DTP_BUILD_DIR:-build}/fuzz. Exits non-zero on a
# crash, leak or sanitizer report (libFuzzer writes the input as crash-*).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
seconds=${1:-60}
out=${DTP_BUILD_DIR:-build}/fuzz
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
apt=($sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600)
if ! command -v clang++ >/dev/null; then
  "${apt[@]}" install -y -qq --no-install-recommends clang
fi
major=$(clang++ -dumpversion | cut -d. -f1)
if ! ls /usr/lib/llvm-"$major"/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1 &&
   ! ls /usr/lib/llvm-"$major"/lib/clang/*/lib/x86_64-*/libclang_rt.fuzzer.a >/dev/null 2>&1; then
  "${apt[@]}" install -y -qq --no-install-recommends "libclang-rt-$major-dev"
fi
mkdir -p "$out/corpus"
cp -n fuzz/corpus/* "$out/corpus/"
clang++ -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -Iinclude -Isrc fuzz/safetensors_fuzz.cpp src/io/safetensors.cpp src/io/safetensors_file.cpp src/io/file_util.cpp -o "$out/safetensors_fuzz" \
  -ltorch_cpu -lc10 -lz
echo "fuzz: running $out/safetensors_fuzz for $seconds s"
# libtorch's own allocations at start-up are not ours to judge.
ASAN_OPTIONS=detect_leaks=0 "$out/safetensors_fuzz" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 \
  -print_final_stats=1 -artifact_prefix="$out/" "$out/corpus"
