#!/usr/bin/env bash
# The whole test suite from scratch: install what is missing, build, run ctest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$(date +%s)
# nodejs and npm: the tokenizer reference test (tests/tokenizers/) runs
# Hugging Face's implementations from npm packages it installs.
DTP_EXTRA_PACKAGES="${DTP_EXTRA_PACKAGES:-} nodejs npm" scripts/setup.sh
cd "${DTP_BUILD_DIR:-build}"
ctest --output-on-failure -j "$(nproc)" --timeout 600
echo "test.sh: build and tests took $(( $(date +%s) - start )) s"
