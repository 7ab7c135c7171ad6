#!/usr/bin/env bash
# Regenerates README.md's supported-ops table from the op sweep
# (tests/op_sweep_test.cpp): runs OpSweep with DTP_OP_SWEEP_MARKDOWN set and
# puts the markdown it writes between the <!-- op-sweep:begin --> and
# <!-- op-sweep:end --> markers. Nothing else in README.md changes.
#
#   scripts/op-table.sh                # uses build/tests/dtp_tests
#   DTP_BUILD_DIR=build-sweep scripts/op-table.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tests=${DTP_BUILD_DIR:-build}/tests/dtp_tests
[ -x "$tests" ] || { echo "op-table.sh: $tests not found; build the dtp_tests target first" >&2; exit 1; }
grep -q '^<!-- op-sweep:begin -->$' README.md && grep -q '^<!-- op-sweep:end -->$' README.md ||
  { echo "op-table.sh: README.md lacks the op-sweep markers" >&2; exit 1; }
table=$(mktemp)
trap 'rm -f "$table" "$table.readme"' EXIT
DTP_OP_SWEEP_MARKDOWN=$table "$tests" --gtest_filter='OpSweep.*' > /dev/null ||
  { echo "op-table.sh: the op sweep failed; README.md is unchanged (run $tests --gtest_filter='OpSweep.*')" >&2; exit 1; }
[ -s "$table" ] || { echo "op-table.sh: the sweep wrote no table" >&2; exit 1; }
awk -v table="$table" '
  /^<!-- op-sweep:begin -->$/ { print; while ((getline line < table) > 0) print line; skip = 1; next }
  /^<!-- op-sweep:end -->$/ { skip = 0 }
  !skip { print }' README.md > "$table.readme"
mv "$table.readme" README.md
echo "op-table.sh: README.md's supported-ops table regenerated ($(grep -c '^| `aten::' "$table") overloads)"
