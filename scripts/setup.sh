#!/usr/bin/env bash
# Installs what dtp needs from Debian/Ubuntu packages (only what is missing),
# then configures and builds in ./build (Release). Sourced by main.sh and test.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# libopenblas0-openmp matters: without it Debian's libtorch runs matmul on the
# reference BLAS, ~25x slower (shared/DESIGN.md, "Real components").
packages=(cmake g++ make libtorch-dev libgloo-dev libopenblas0-openmp libgtest-dev
          libbenchmark-dev libcli11-dev nlohmann-json3-dev libfmt-dev fortunes)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

jobs=$(nproc)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$jobs" -- --no-print-directory "$@"
