#!/usr/bin/env bash
# Builds dtp against the libtorch inside a pip-installed torch wheel, with
# CUDA and NCCL, in ${DTP_BUILD_DIR:-build-wheel}; `test` then runs the suite
# (the `cuda` label included). For GPU machines that have the wheel rather
# than Debian's libtorch:
#
#   scripts/wheel.sh          # configure and build
#   scripts/wheel.sh test     # and run ctest
#
# - libtorch: CMAKE_PREFIX_PATH from python3's torch.utils.cmake_prefix_path.
# - gloo's headers, which the wheel lacks (NOTE: [Gloo headers] in
#   src/comm/gloo.h): those of the gloo commit the wheel's torch pins (the
#   table below), exported from gloo's git: DTP_GLOO_GIT (a clone or mirror of
#   github.com/pytorch/gloo; cloned from GitHub when unset), or DTP_GLOO_INCLUDE
#   (a folder this script exported before, elsewhere: it holds .gloo-commit).
#   Headers only: no second gloo is built or linked.
# - Debian's -dev packages dtp needs: apt installs them where there is apt
#   (scripts/setup.sh's list); elsewhere DTP_DEBS names a folder of .deb files
#   (libgtest-dev, libcli11-dev, nlohmann-json3-dev, libfmt-dev with its
#   libfmt, zlib1g-dev, libbenchmark-dev with its libbenchmark), unpacked into
#   the build folder.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build=${DTP_BUILD_DIR:-build-wheel}
mkdir -p "$build"
build=$(cd "$build" && pwd)

read -r torch_version prefix < <(python3 -c 'import torch; print(torch.__version__.split("+")[0], torch.utils.cmake_prefix_path)') || true
[ -n "${prefix:-}" ] || { echo "wheel: python3 cannot import torch: install the torch wheel first (pip install torch)" >&2; exit 1; }
echo "wheel: torch $torch_version, $prefix"

# The gloo commit of PyTorch's third_party/gloo per release (pytorch's
# `git ls-tree v<version> third_party/gloo`). A new torch release: add its row.
case "$torch_version" in
  2.[3-7].*) gloo=5354032ea08eadd7fc4456477f7f7c6308818509 ;;
  2.8.*) gloo=c7b7b022c124d9643957d9bd55f57ac59fce8fa2 ;;
  2.9.* | 2.10.*) gloo=54cbae0d3a67fa890b4c3d9ee162b7860315e341 ;;
  2.11.* | 2.12.*) gloo=3135b0b41b67dde590eef0938a0bf3d6238df5f7 ;;
  *)
    echo "wheel: no gloo commit known for torch $torch_version. Look it up (in pytorch's git:" \
      "git ls-tree v$torch_version third_party/gloo) and add it to the table in $0." >&2
    exit 1
    ;;
esac

gloo_include=${DTP_GLOO_INCLUDE:-$build/gloo-$gloo}
if [ ! -e "$gloo_include/.gloo-commit" ]; then
  [ -z "${DTP_GLOO_INCLUDE:-}" ] || { echo "wheel: $gloo_include holds no .gloo-commit" >&2; exit 1; }
  git_dir=${DTP_GLOO_GIT:-$build/gloo.git}
  [ -e "$git_dir" ] || git clone --bare --filter=blob:none https://github.com/pytorch/gloo "$git_dir"
  rm -rf "$gloo_include" && mkdir -p "$gloo_include"
  git -C "$git_dir" archive "$gloo" gloo | tar -x -C "$gloo_include" --wildcards '*.h'
  echo "$gloo" >"$gloo_include/.gloo-commit"
fi
[ "$(cat "$gloo_include/.gloo-commit")" = "$gloo" ] || {
  echo "wheel: $gloo_include holds gloo $(cat "$gloo_include/.gloo-commit"), torch $torch_version needs $gloo" >&2
  exit 1
}

deps=()
if [ -n "${DTP_DEBS:-}" ]; then
  rm -rf "$build/deps" && mkdir -p "$build/deps"
  for deb in "$DTP_DEBS"/*.deb; do dpkg-deb -x "$deb" "$build/deps"; done
  deps=("$build/deps/usr")
  export LD_LIBRARY_PATH="$build/deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
elif command -v apt-get >/dev/null; then
  DTP_TORCH=wheel scripts/setup.sh  # the other packages only
fi

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DDTP_WITH_NCCL=ON \
  -DCMAKE_PREFIX_PATH="$prefix${deps[*]:+;${deps[*]}}" -DDTP_GLOO_INCLUDE_DIR="$gloo_include"
cmake --build "$build" -j "$(nproc)"

if [ "${1:-}" = test ]; then
  cd "$build"
  ctest -j "$(nproc)" --output-on-failure
fi
