#!/usr/bin/env bash
# Builds dtp against the libtorch inside a pip-installed torch wheel, with
# CUDA and NCCL, in ${DTP_BUILD_DIR:-build-wheel}; `test` then runs the suite
# (the `cuda` label included). For GPU machines that have the wheel rather
# than Debian's libtorch:
#
#   scripts/wheel.sh            # configure and build
#   scripts/wheel.sh test       # and run ctest
#   scripts/wheel.sh configure  # configure only
#
# - libtorch: CMAKE_PREFIX_PATH from python3's torch.utils.cmake_prefix_path.
# - gloo's headers, which the wheel lacks (NOTE: [Gloo headers] in
#   src/comm/gloo.h): those of the gloo commit the wheel's torch pins,
#   exported by scripts/gloo-headers.sh from gloo's git (DTP_GLOO_GIT, or a
#   clone), or DTP_GLOO_INCLUDE: a folder it exported before, elsewhere
#   (scripts/gpu-carry.sh). Headers only: no second gloo is built or linked.
# - Debian's -dev packages dtp needs: apt installs them where there is apt
#   (scripts/setup.sh's list); elsewhere DTP_DEBS names a folder of .deb files
#   (scripts/gpu-carry.sh downloads them), unpacked into the build folder;
#   the training text (fortunes) is then read from there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build=${DTP_BUILD_DIR:-build-wheel}
mkdir -p "$build"
build=$(cd "$build" && pwd)

read -r torch_version prefix < <(python3 -c 'import torch; print(torch.__version__.split("+")[0], torch.utils.cmake_prefix_path)') || true
[ -n "${prefix:-}" ] || { echo "wheel: python3 cannot import torch: install the torch wheel first (pip install torch)" >&2; exit 1; }
echo "wheel: torch $torch_version, $prefix"

gloo=$(scripts/gloo-headers.sh "$torch_version")
gloo_include=${DTP_GLOO_INCLUDE:-$(scripts/gloo-headers.sh "$torch_version" "$build")}
[ "$(cat "$gloo_include/.gloo-commit" 2>/dev/null)" = "$gloo" ] || {
  echo "wheel: $gloo_include does not hold gloo $gloo, the gloo of torch $torch_version (scripts/gloo-headers.sh)" >&2
  exit 1
}
gloo_include=$(cd "$gloo_include" && pwd)

deps=() corpus=()
if [ -n "${DTP_DEBS:-}" ]; then
  rm -rf "$build/deps" && mkdir -p "$build/deps"
  for deb in "$DTP_DEBS"/*.deb; do dpkg-deb -x "$deb" "$build/deps"; done
  deps=("$build/deps/usr")
  corpus=(-DDTP_DEFAULT_CORPUS="$build/deps/usr/share/games/fortunes")
  export LD_LIBRARY_PATH="$build/deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
elif command -v apt-get >/dev/null; then
  DTP_TORCH=wheel scripts/setup.sh  # the other packages only
fi

# nccl.h, which ProcessGroupNCCL.hpp includes: the wheel has it in its
# nvidia-nccl package, not among torch's headers.
nccl=()
site=${prefix%/torch/share/cmake}
nccl_h=$(find "$site/nvidia" -name nccl.h -path "*include*" 2>/dev/null | head -1) || true
if [ -n "$nccl_h" ]; then
  nccl=(-DDTP_NCCL_INCLUDE_DIR="$(dirname "$nccl_h")")
  echo "wheel: $nccl_h"
fi

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DDTP_WITH_NCCL=ON \
  -DCMAKE_PREFIX_PATH="$prefix${deps[*]:+;${deps[*]}}" -DDTP_GLOO_INCLUDE_DIR="$gloo_include" "${corpus[@]}" "${nccl[@]}"
[ "${1:-}" = configure ] && exit 0
cmake --build "$build" -j "$(nproc)"

if [ "${1:-}" = test ]; then
  cd "$build"
  ctest -j "$(nproc)" --output-on-failure
fi
