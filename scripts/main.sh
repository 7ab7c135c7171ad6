#!/usr/bin/env bash
# The main job: install what is missing, build, and run dtp-train on 2 ranks.
# Extra arguments go to dtp-train.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build=${DTP_BUILD_DIR:-build}
scripts/setup.sh dtprun dtp-train
exec "$build/apps/dtprun/dtprun" -n 2 "$build/apps/dtp-train" "$@"
