#!/usr/bin/env bash
# The whole test suite from scratch: install what is missing, build, run ctest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$(date +%s)
scripts/setup.sh
cd "${DTP_BUILD_DIR:-build}"
ctest --output-on-failure -j "$(nproc)" --timeout 600
echo "test.sh: build and tests took $(( $(date +%s) - start )) s"
