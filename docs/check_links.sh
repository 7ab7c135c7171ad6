#!/usr/bin/env bash
# Checks the relative links of the project's markdown (README.md, docs/*.md,
# bench/README.md): each [text](path) must name a file or folder that exists,
# relative to the page, and each #anchor into a markdown page must be one of
# its headings (GitHub's slugs: lower case, punctuation dropped, spaces to
# hyphens). Links to http(s) addresses are not fetched. Fenced code blocks
# (indented too, as in a list item) and `inline code` are skipped. Exits 1 naming each broken link.
#
#   docs/check_links.sh            # from anywhere in the checkout
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# slugs FILE: the anchors of FILE's headings, one a line.
slugs() {
  awk '/^ *```/ { fence = !fence; next } !fence && /^#+ / { sub(/^#+ +/, ""); print }' "$1" |
    tr 'A-Z' 'a-z' | sed -e 's/[^a-z0-9 _-]//g' -e 's/ /-/g'
}

bad=0 n=0
for page in README.md docs/*.md bench/README.md; do
  dir=$(dirname "$page")
  links=$(awk '/^ *```/ { fence = !fence; next } !fence' "$page" | sed -e 's/`[^`]*`//g' |
            grep -o '\]([^)]*)' | sed -e 's/^](//' -e 's/)$//' -e 's/ .*//' || true)
  for link in $links; do
    case "$link" in http://* | https://* | mailto:*) continue ;; esac
    n=$((n + 1))
    path=${link%%#*}
    anchor=""
    [[ "$link" == *"#"* ]] && anchor=${link#*#}
    target=$page
    [ -n "$path" ] && target=$dir/$path
    if [ ! -e "$target" ]; then
      echo "$page: broken link '$link' ($target does not exist)"
      bad=1
      continue
    fi
    if [ -n "$anchor" ] && [[ "$target" == *.md ]] && ! slugs "$target" | grep -qxF -- "$anchor"; then
      echo "$page: broken link '$link' (no heading '#$anchor' in $target)"
      bad=1
    fi
  done
done
[ "$bad" -eq 0 ] && echo "check_links: $n relative links resolve"
exit "$bad"
