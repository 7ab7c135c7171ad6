#!/usr/bin/env bash
# Runs a command of this checkout inside a Debian 13 (trixie) root, so that
# the libtorch 2.x line (Debian 13's libtorch-dev 2.6) is built and tested on
# a Debian 12 machine too. Default command: the README's test command,
# building in build-debian13/.
#
#   scripts/debian13.sh                      # the whole suite against libtorch 2.6
#   scripts/debian13.sh scripts/main.sh      # the main job
#
# The root is made once with debootstrap (minbase, Debian's archive only) in
# ${DTP_DEBIAN13_ROOT:-/var/tmp/dtp-debian13} and reused while the machine
# keeps it; setup.sh installs what is missing inside it with apt, exactly as
# on a native Debian 13, plus python3-torch and python3-safetensors
# (DTP_EXTRA_PACKAGES) for the Hugging Face check against Python and the tests
# that start dtp ranks under a real torchrun. Needs root (or sudo) for
# debootstrap, mount and chroot.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
checkout=$(pwd)
root=${DTP_DEBIAN13_ROOT:-/var/tmp/dtp-debian13}
mirror=${DTP_DEBIAN_MIRROR:-http://deb.debian.org/debian}
((${#@})) || set -- scripts/test.sh

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"

if [ ! -e "$root/.dtp-root-complete" ]; then
  if ! command -v debootstrap >/dev/null; then
    echo "debian13: installing debootstrap"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq debootstrap
  fi
  echo "debian13: creating a trixie root in $root (debootstrap, minbase)"
  $sudo rm -rf "$root"
  $sudo debootstrap --variant=minbase trixie "$root" "$mirror" >/dev/null
  $sudo touch "$root/.dtp-root-complete"
fi
# Name resolution as on the host (torchrun's agents advertise the hostname).
$sudo cp /etc/resolv.conf /etc/hosts "$root/etc/"
# The host's trusted certificates, for the tests that npm-install their
# references (a network that re-signs TLS with its own CA): Node inside the
# root trusts them too (NODE_EXTRA_CA_CERTS below).
host_ca=""
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  $sudo cp /etc/ssl/certs/ca-certificates.crt "$root/etc/dtp-host-ca-certificates.crt"
  host_ca=/etc/dtp-host-ca-certificates.crt
fi

# proc, dev (with shm for Gloo) and the checkout, unmounted on every exit.
mounts=()
cleanup() {
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do $sudo umount -R "${mounts[i]}" 2>/dev/null || true; done
  # ip netns add (tests/multihost probing, then skipping) mounts the root's run/netns.
  if mountpoint -q "$root/run/netns"; then $sudo umount "$root/run/netns" 2>/dev/null || true; fi
}
trap cleanup EXIT
mountpoint -q "$root/proc" || { $sudo mount -t proc proc "$root/proc"; mounts+=("$root/proc"); }
if ! mountpoint -q "$root/dev"; then
  $sudo mount --rbind /dev "$root/dev"
  $sudo mount --make-rslave "$root/dev"
  mounts+=("$root/dev")
fi
$sudo mkdir -p "$root/dtp"
$sudo mount --bind "$checkout" "$root/dtp"
mounts+=("$root/dtp")

$sudo chroot "$root" /usr/bin/env -i HOME=/root TERM="${TERM:-dumb}" LANG=C.UTF-8 \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  DTP_BUILD_DIR="${DTP_BUILD_DIR:-build-debian13}" DTP_CHROOT_LEG=1 DTP_EXTRA_PACKAGES="${DTP_EXTRA_PACKAGES-python3-torch python3-safetensors}" \
  ${OMP_NUM_THREADS:+OMP_NUM_THREADS=$OMP_NUM_THREADS} ${DTP_STOP_AFTER:+DTP_STOP_AFTER=$DTP_STOP_AFTER} ${host_ca:+NODE_EXTRA_CA_CERTS=$host_ca} \
  /bin/bash -c 'cd /dtp && exec "$@"' debian13 "$@"
