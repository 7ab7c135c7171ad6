#!/usr/bin/env bash
# Install.ConsumerLinksEachTargetAlone: installs the build into a prefix
# inside WORK, configures tests/consumer against it (find_package(dtp)),
# builds one program per exported target and runs each, then runs one
# written against the previous release's headers (release_10df3d0.cpp, on 4
# ranks) and one using the tokenizers' headers from before they moved to
# dtp::text (moved_headers.cpp). Everything it writes stays in WORK (in the
# build tree), which a passing run removes.
#
# Usage: run.sh BUILD_DIR CONSUMER_SOURCE_DIR WORK [cmake -D options for the consumer...]
set -euo pipefail
build=$1 source=$2 work=$3
shift 3
rm -rf "$work"
mkdir -p "$work/files"
echo "== cmake --install $build --prefix $work/prefix"
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
config=$(find "$work/prefix" -name dtpConfig.cmake -print -quit)
[[ -n $config ]] || { echo "run.sh: cmake --install put no dtpConfig.cmake under $work/prefix" >&2; exit 1; }
echo "== configure $source with dtp_DIR=${config%/*}"
cmake -S "$source" -B "$work/build" -Ddtp_DIR="${config%/*}" "$@"
echo "== build"
cmake --build "$work/build" -j "${DTP_CONSUMER_JOBS:-2}" 2>&1 | tee "$work/build.log"
# The previous release's program builds through the deprecated forwarding;
# GCC says so in a note (NOTE: [Deprecated forwarding]).
echo "== deprecation notes while building: $(grep -c 'pragma message: dtp/' "$work/build.log" || true)"
dtprun=$work/prefix/bin/dtprun
[[ -x $dtprun ]] || { echo "run.sh: $dtprun was not installed (configure dtp with DTP_BUILD_APPS=ON)" >&2; exit 1; }
echo "== run"
"$work/build/use_io" "$work/files"
"$dtprun" -n 2 "$work/build/use_dtp"
"$dtprun" -n 2 "$work/build/use_dcp" "$work/files"
"$work/build/use_inference"
"$work/build/use_text"
"$work/build/use_models"
"$work/build/use_moved_headers"
"$dtprun" -n 4 "$work/build/use_release_10df3d0"
rm -rf "$work"
echo "every target linked alone and ran"
