#!/usr/bin/env bash
# The include graph between dtp's folders (NOTE: [Library targets by folder]
# in CMakeLists.txt): every #include "..." in src/ and include/dtp/ may only
# reach its own folder or one the layering below allows. The layering is
# data: a folder may include the folders after its colon, each of which must
# be listed on an earlier line, so that no arrow points back up and no circle
# is possible. Public headers (include/dtp/) include public headers only: an
# installed header cannot reach src/.
#
# Usage: include_graph.sh [REPO_ROOT]; exit 1 naming each offending #include.
set -euo pipefail
root=${1:-$(cd "$(dirname "$0")/../.." && pwd)}
cd "$root"

# Bottom first. dtp::io and dtp::text (tokenizers, chat templates) are
# comm-free (libtorch only); dtp::dtp is comm .. fsdp; dtp::dcp,
# dtp::inference and dtp::models sit above it.
LAYERS='
io:
text:
comm:
mesh:      comm
dtensor:   comm mesh
debug:     comm mesh dtensor
nn:        comm mesh dtensor
ep:        comm mesh dtensor
optim:     comm mesh dtensor nn
ac:        comm mesh dtensor nn
pp:        comm mesh dtensor nn
tp:        comm mesh dtensor nn
fsdp:      comm mesh dtensor nn
amp:       comm mesh dtensor nn fsdp
cp:        comm mesh dtensor nn
dcp:       comm mesh dtensor nn io
inference: comm mesh dtensor text
models:    comm mesh dtensor debug nn ep optim ac pp tp fsdp amp cp dcp inference io text
'
# The folder of each header directly in include/dtp/.
TOP_HEADERS='
comm:    process_group.h comm_counter.h
mesh:    device_mesh.h parallel_dims.h
dtensor: dtensor.h dtensor_spec.h placement.h random.h register_sharding.h local_map.h explicit_redistribute.h fused_ops.h
nn:      module_utils.h distribute_module.h
debug:   trace.h visualize_sharding.h
'

declare -A allowed=() top=()
fail=0
complain() { echo "include_graph: $*" >&2; fail=1; }

while read -r line; do
  [[ -z $line ]] && continue
  folder=${line%%:*}
  deps=${line#*:}
  for d in $deps; do
    [[ -n ${allowed[$d]+x} ]] ||
      complain "LAYERS: '$folder' may include '$d', which is not listed above it (a layer may only include layers below it)"
  done
  allowed[$folder]=" $(echo $deps) "
done <<< "$LAYERS"
while read -r line; do
  [[ -z $line ]] && continue
  for h in ${line#*:}; do top[$h]=${line%%:*}; done
done <<< "$TOP_HEADERS"

# The folder a file or an include path belongs to ("" for src/pch.h).
folder_of_file() {
  local p=$1
  case $p in
    src/*/*) p=${p#src/}; echo "${p%%/*}" ;;
    src/*) echo "" ;;
    include/dtp/*/*) p=${p#include/dtp/}; echo "${p%%/*}" ;;
    include/dtp/*) top_folder "${p#include/dtp/}" "$p" ;;
  esac
}
top_folder() {
  if [[ -n ${top[$1]+x} ]]; then echo "${top[$1]}"; else echo "?"; fi
}

checked=0
while IFS= read -r hit; do
  file=${hit%%:*}; rest=${hit#*:}; lineno=${rest%%:*}; text=${rest#*:}
  inc=${text#*\"}; inc=${inc%%\"*}
  from=$(folder_of_file "$file")
  [[ -z $from ]] && continue
  if [[ $from == "?" ]]; then
    complain "$file: a header of include/dtp/ in no folder: add it to TOP_HEADERS in $0"
    continue
  fi
  if [[ $inc == dtp/*/* ]]; then
    to=${inc#dtp/}; to=${to%%/*}
  elif [[ $inc == dtp/* ]]; then
    to=$(top_folder "${inc#dtp/}")
    if [[ $to == "?" ]]; then
      complain "$file:$lineno: #include \"$inc\": a header of include/dtp/ in no folder: add it to TOP_HEADERS in $0"
      continue
    fi
  elif [[ $file == include/* ]]; then
    complain "$file:$lineno: #include \"$inc\": a public header includes a file of src/, which is not installed (include dtp/... headers only, or move the include to the .cpp)"
    continue
  elif [[ $inc == */* ]]; then
    to=${inc%%/*}
  else
    continue  # beside the file, in its own folder
  fi
  checked=$((checked + 1))
  [[ $to == "$from" ]] && continue
  if [[ -z ${allowed[$from]+x} ]]; then
    complain "$file:$lineno: folder '$from' is not in LAYERS of $0: add it at its place in the layering"
  elif [[ -z ${allowed[$to]+x} ]]; then
    complain "$file:$lineno: #include \"$inc\": folder '$to' is not in LAYERS of $0: add it at its place in the layering"
  elif [[ ${allowed[$from]} != *" $to "* ]]; then
    complain "$file:$lineno: #include \"$inc\": '$from' may not include '$to' (it may include:${allowed[$from]% }); move the code or cut the dependency"
  fi
done < <(grep -rnE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' src include/dtp --include='*.h' --include='*.cpp' --include='*.hpp' | sort)

[[ $checked -gt 0 ]] || complain "no #include found under $root/src and $root/include/dtp"
if [[ $fail -ne 0 ]]; then
  echo "include_graph: FAILED" >&2
  exit 1
fi
echo "include_graph: $checked #includes of src/ and include/dtp/ follow the layering"
