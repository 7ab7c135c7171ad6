#!/usr/bin/env bash
# Installs what dtp needs from Debian/Ubuntu packages (only what is missing),
# then configures and builds in ${DTP_BUILD_DIR:-build} (Release). Called by
# main.sh and test.sh; extra arguments name the targets to build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build=${DTP_BUILD_DIR:-build}

# The same package names serve Debian 12 (libtorch 1.13), Debian 13
# (libtorch 2.6) and Ubuntu 24.04. libopenblas0-openmp matters: without it
# Debian's libtorch runs matmul on the reference BLAS, ~25x slower
# (docs/architecture.md, "Real components").
# DTP_TORCH names another libtorch, for the script that then builds:
# "wheel" (scripts/wheel.sh: a pip wheel's; the other packages only) or
# "debian-cuda" (scripts/debian13-cuda.sh: Debian 13 contrib's CUDA libtorch
# with NCCL). Nothing is built here then.
# libpcre2-dev and libutf8proc-dev: tokenizer.json's split regexes and NFC;
# unicode-data: the Unicode tables the tokenizer tests check them against.
# libcpp-httplib-dev: dtp-serve's HTTP server. libeigen3-dev: the GEMV of
# decode at batch 1 (NOTE: [One-row linear]).
packages=(cmake g++ make libgtest-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev zlib1g-dev libfmt-dev
          pkgconf libsentencepiece-dev libpcre2-dev libutf8proc-dev libcpp-httplib-dev libeigen3-dev fortunes unicode-data
          ${DTP_EXTRA_PACKAGES:-})
case "${DTP_TORCH:-}" in
  "") packages+=(libtorch-dev libgloo-dev libopenblas0-openmp) ;;
  wheel) ;;
  debian-cuda) packages+=(libtorch-cuda-dev libgloo-cuda-dev libnccl-dev nvidia-cuda-toolkit) ;;
  *) echo "setup: DTP_TORCH=$DTP_TORCH is none of wheel, debian-cuda (or unset)" >&2; exit 1 ;;
esac
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  # Wait for another apt (unattended upgrades, a parallel setup) instead of failing.
  apt=($sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600)
  "${apt[@]}" update -qq
  "${apt[@]}" install -y -qq --no-install-recommends "${missing[@]}"
fi

# DTP_STOP_AFTER=install: packages only (.ci/run prepares a leg's machine
# while another leg builds).
[ "${DTP_STOP_AFTER:-}" != install ] || exit 0
[ -z "${DTP_TORCH:-}" ] || exit 0
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$(nproc)" -- --no-print-directory "$@"
