#!/usr/bin/env bash
# Fills .gpu/ (git ignores it) for a GPU machine that has the torch wheel but
# neither apt nor the network (the device tool's machines): the .deb files of
# dtp's other Debian dependencies, and gloo's headers for that torch release.
#
#   scripts/gpu-carry.sh 2.11.0       # here, with Debian's apt and gloo's git
#   # there, with .gpu carried along:
#   DTP_DEBS=.gpu/debs DTP_GLOO_INCLUDE=$(ls -d .gpu/gloo-*) scripts/wheel.sh test
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
version=${1:?the wheel\'s torch version, e.g. 2.11.0}
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"
rm -rf .gpu && mkdir -p .gpu/debs
(cd .gpu/debs && apt-get download -qq libgtest-dev googletest libcli11-dev nlohmann-json3-dev libfmt-dev libfmt9 \
  zlib1g-dev libbenchmark-dev libbenchmark1debian fortunes fortunes-min)
scripts/gloo-headers.sh "$version" .gpu >/dev/null
rm -rf .gpu/gloo.git
du -sh .gpu
