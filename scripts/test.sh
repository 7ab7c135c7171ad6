#!/usr/bin/env bash
# The whole test suite from scratch: install what is missing, build, run ctest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$(date +%s)
# node and npm: the tokenizer reference test (tests/tokenizers/) and the
# dtp-serve test run Hugging Face's and OpenAI's npm packages. Debian's
# nodejs/npm are installed only where the commands are missing: a machine
# with another Node.js (NodeSource's bundles npm) keeps it, since Debian's
# npm cannot be installed beside it.
node_packages=""
command -v node >/dev/null || node_packages+=" nodejs"
command -v npm >/dev/null || node_packages+=" npm"
# chromium: the chat page test (tests/serve/chat_page_test.sh) runs Debian's
# chromium headless. Ubuntu has no chromium deb (its chromium-browser installs
# a snap): there it is left out and the test skips.
if grep -qx 'ID=debian' /etc/os-release 2>/dev/null && ! command -v chromium >/dev/null; then
  node_packages+=" chromium"
fi
# tests/multihost (root): ip and tc (iproute2), ping (iputils-ping: hosts wait
# for their bridge by it, else 5 s per case), and the launchers it runs
# across simulated hosts: Open MPI's mpirun, Slurm (slurmctld, slurmd, srun;
# nothing is started at install without systemd, the test starts its own),
# Debian's torchrun (python3-torch; 1.13 on Debian 12). The mpirun and
# slurmd cases run with Open MPI 4 and Slurm 22 only (they skip on Debian 13's
# newer ones), so Debian 13 goes without those two.
multihost_packages=" iproute2 iputils-ping"
grep -qx 'VERSION_CODENAME=trixie' /etc/os-release 2>/dev/null || multihost_packages+=" openmpi-bin slurm-wlm"
if grep -qx 'ID=debian' /etc/os-release 2>/dev/null && ! command -v torchrun >/dev/null; then
  multihost_packages+=" python3-torch"
fi
# DTP_CHROOT_LEG=1 (scripts/debian13.sh): a chroot leg run for its libtorch
# alone, where the multi-host cases skip (ip netns is unusable in a chroot)
# and the chat page tests nothing libtorch-specific: neither is installed.
# Nor does it run the tokenizers against Hugging Face's on real files
# (dtp::text has no libtorch beyond c10; 6 of CI's 90 minutes): the first
# leg does.
skip=()
if [[ -n ${DTP_CHROOT_LEG:-} ]]; then
  node_packages=${node_packages/ chromium/}
  multihost_packages=""
  skip=(-E '^TokenizerReference\.')
fi
DTP_EXTRA_PACKAGES="${DTP_EXTRA_PACKAGES:-}$node_packages$multihost_packages" scripts/setup.sh
# DTP_STOP_AFTER=install or build: stop before ctest (.ci/run overlaps one
# leg's tests with the other leg's build).
case "${DTP_STOP_AFTER:-}" in
  "") ;;
  install | build) exit 0 ;;
  *) echo "test.sh: DTP_STOP_AFTER=$DTP_STOP_AFTER is none of install, build (or unset)" >&2; exit 1 ;;
esac
cd "${DTP_BUILD_DIR:-build}"
ctest --output-on-failure -j "$(nproc)" --timeout 600 "${skip[@]}"
echo "test.sh: build and tests took $(( $(date +%s) - start )) s"
