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
DTP_EXTRA_PACKAGES="${DTP_EXTRA_PACKAGES:-}$node_packages" scripts/setup.sh
cd "${DTP_BUILD_DIR:-build}"
ctest --output-on-failure -j "$(nproc)" --timeout 600
echo "test.sh: build and tests took $(( $(date +%s) - start )) s"
