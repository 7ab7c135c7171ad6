#!/usr/bin/env bash
# Builds dtp with NCCL against Debian 13's CUDA libtorch (contrib's
# libtorch-cuda-dev 2.6, CUDA 12.4, NCCL 2.22) in a Debian 13 root of its own
# (${DTP_DEBIAN13_CUDA_ROOT:-/var/tmp/dtp-debian13-cuda}), on a machine with
# or without a GPU: the NCCL and CUDA code paths compile and link, and with a
# cuDNN the suite runs (without a GPU its CUDA tests say they are skipped).
#
#   scripts/debian13-cuda.sh                          # build only
#   DTP_CUDNN_LIB=/usr/local/cuda/lib64 scripts/debian13-cuda.sh test
#
# Debian's nvidia-cudnn is an installer that downloads cuDNN from NVIDIA at
# install time; a placeholder package stands in for it. dtp never calls cuDNN,
# but libtorch_cuda.so needs libcudnn.so.9 to load: without DTP_CUDNN_LIB (a
# folder with NVIDIA's libcudnn*.so.9) programs link with
# --allow-shlib-undefined and are not run (tests are listed at ctest time).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export DTP_DEBIAN13_ROOT=${DTP_DEBIAN13_CUDA_ROOT:-/var/tmp/dtp-debian13-cuda}
export DTP_BUILD_DIR=build-debian13-cuda DTP_EXTRA_PACKAGES=""
root=$DTP_DEBIAN13_ROOT
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"

scripts/debian13.sh true  # makes the root (debootstrap) where there is none
echo "deb ${DTP_DEBIAN_MIRROR:-http://deb.debian.org/debian} trixie main contrib non-free non-free-firmware" |
  $sudo tee "$root/etc/apt/sources.list" >/dev/null
if [ ! -e "$root/var/lib/dpkg/info/nvidia-cudnn.list" ]; then
  placeholder=$(mktemp -d)
  mkdir -p "$placeholder/DEBIAN"
  cat >"$placeholder/DEBIAN/control" <<'EOF'
Package: nvidia-cudnn
Version: 9.0.0.312~cuda12
Architecture: amd64
Maintainer: dtp <dtp@localhost>
Provides: libcudnn-dev, libcudnn.so, libcudnn.so.9
Description: placeholder for Debian's cuDNN download script (dtp's CUDA build check)
EOF
  dpkg-deb --build "$placeholder" "$placeholder.deb" >/dev/null
  $sudo cp "$placeholder.deb" "$root/tmp/nvidia-cudnn-placeholder.deb"
  $sudo chroot "$root" dpkg -i /tmp/nvidia-cudnn-placeholder.deb >/dev/null
  rm -rf "$placeholder" "$placeholder.deb"
fi
cmake_flags=()
if [ -n "${DTP_CUDNN_LIB:-}" ]; then
  $sudo mkdir -p "$root/usr/local/lib/cudnn"
  $sudo cp -a "$DTP_CUDNN_LIB"/libcudnn*.so.9* "$root/usr/local/lib/cudnn/"
  echo /usr/local/lib/cudnn | $sudo tee "$root/etc/ld.so.conf.d/cudnn.conf" >/dev/null
  $sudo chroot "$root" ldconfig
else
  cmake_flags=(-DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST)
  [ "${1:-}" != test ] || { echo "debian13-cuda: 'test' needs DTP_CUDNN_LIB (see the top of $0)" >&2; exit 1; }
fi

scripts/debian13.sh bash -c '
  set -euo pipefail
  DTP_TORCH=debian-cuda scripts/setup.sh  # installs what is missing, builds nothing
  what=$1
  shift
  cmake -S . -B "$DTP_BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DDTP_WITH_NCCL=ON -DCMAKE_EXE_LINKER_FLAGS= \
    -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=POST_BUILD "$@" -Wno-dev >/dev/null
  cmake --build "$DTP_BUILD_DIR" -j "$(nproc)" -- --no-print-directory
  if [ "$what" = test ]; then cd "$DTP_BUILD_DIR" && ctest --output-on-failure -j "$(nproc)" --timeout 600; fi
' debian13-cuda "${1:-build}" "${cmake_flags[@]}"
