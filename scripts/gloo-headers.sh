#!/usr/bin/env bash
# The headers of the gloo that a torch release's wheel was built with
# (PyTorch's third_party/gloo pin; NOTE: [Gloo headers] in src/comm/gloo.h):
#
#   scripts/gloo-headers.sh 2.11.0 DIR   # exports them to DIR/gloo-<commit>, prints that folder
#   scripts/gloo-headers.sh 2.11.0       # prints the commit only
#
# gloo's git: DTP_GLOO_GIT (a clone or mirror of github.com/pytorch/gloo),
# else a clone made in DIR/gloo.git. Headers only: no gloo is built.
set -euo pipefail
version=${1:?torch version, e.g. 2.11.0}

# pytorch's `git ls-tree v<version> third_party/gloo`. A new release: add its row.
case "$version" in
  2.[3-7].*) gloo=5354032ea08eadd7fc4456477f7f7c6308818509 ;;
  2.8.*) gloo=c7b7b022c124d9643957d9bd55f57ac59fce8fa2 ;;
  2.9.* | 2.10.*) gloo=54cbae0d3a67fa890b4c3d9ee162b7860315e341 ;;
  2.11.* | 2.12.*) gloo=3135b0b41b67dde590eef0938a0bf3d6238df5f7 ;;
  *)
    echo "gloo-headers: no gloo commit known for torch $version. Look it up (in pytorch's git:" \
      "git ls-tree v$version third_party/gloo) and add it to the table in $0." >&2
    exit 1
    ;;
esac
if [ -z "${2:-}" ]; then
  echo "$gloo"
  exit 0
fi
out="$2/gloo-$gloo"
if [ ! -e "$out/.gloo-commit" ]; then
  git_dir=${DTP_GLOO_GIT:-$2/gloo.git}
  [ -e "$git_dir" ] || git clone --bare --filter=blob:none https://github.com/pytorch/gloo "$git_dir" >&2
  rm -rf "$out" && mkdir -p "$out"
  git -C "$git_dir" archive "$gloo" gloo | tar -x -C "$out" --wildcards '*.h'
  echo "$gloo" >"$out/.gloo-commit"
fi
echo "$out"
