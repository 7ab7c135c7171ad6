#!/usr/bin/env bash
# Regenerates the supported-ops table of docs/dtensor.md from the op sweep
# (tests/op_sweep_test.cpp): runs OpSweep with DTP_OP_SWEEP_MARKDOWN set and
# puts the markdown it writes between the <!-- op-sweep:begin --> and
# <!-- op-sweep:end --> markers. Nothing else in the page changes.
#
#   scripts/op-table.sh                # uses build/tests/dtp_tests
#   DTP_BUILD_DIR=build-sweep scripts/op-table.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tests=${DTP_BUILD_DIR:-build}/tests/dtp_tests
page=docs/dtensor.md
[ -x "$tests" ] || { echo "op-table.sh: $tests not found; build the dtp_tests target first" >&2; exit 1; }
grep -q '^<!-- op-sweep:begin -->$' "$page" && grep -q '^<!-- op-sweep:end -->$' "$page" ||
  { echo "op-table.sh: $page lacks the op-sweep markers" >&2; exit 1; }
table=$(mktemp)
trap 'rm -f "$table" "$table.readme"' EXIT
DTP_OP_SWEEP_MARKDOWN=$table "$tests" --gtest_filter='OpSweep.*' > /dev/null ||
  { echo "op-table.sh: the op sweep failed; $page is unchanged (run $tests --gtest_filter='OpSweep.*')" >&2; exit 1; }
[ -s "$table" ] || { echo "op-table.sh: the sweep wrote no table" >&2; exit 1; }
awk -v table="$table" '
  /^<!-- op-sweep:begin -->$/ { print; while ((getline line < table) > 0) print line; skip = 1; next }
  /^<!-- op-sweep:end -->$/ { skip = 0 }
  !skip { print }' "$page" > "$table.readme"
mv "$table.readme" "$page"
echo "op-table.sh: $page's supported-ops table regenerated ($(grep -c '^| `aten::' "$table") overloads)"
