#!/usr/bin/env bash
# Chaos on the shared-memory path: W ranks of `mp_worker chaos`, no launcher
# (nobody stops the survivors for them); rank 1 SIGKILLs itself inside a
# loop of small all_reduces. Exits with rank 0's status (its error is the
# survivors' message), or 99 when a segment of this job is left in /dev/shm.
#
#   shm_chaos.sh MP_WORKER [W [SCENARIO]]   (WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)
#
# SCENARIO is mp_worker's subcommand (chaos; pipeline_chaos kills rank 1
# mid-pipeline instead).
set -u
worker=$1 world=${2:-4} scenario=${3:-chaos}
export WORLD_SIZE=$world
pids=()
for ((r = 0; r < world; r++)); do
  RANK=$r "$worker" "$scenario" &
  pids+=($!)
done
wait "${pids[0]}"
status=$?
wait
left=$(ls /dev/shm | grep -E "^dtp-(${pids[*]// /|})-" || true)
if [ -n "$left" ]; then
  echo "shm_chaos: left in /dev/shm: $left"
  exit 99
fi
echo "shm_chaos: nothing left in /dev/shm"
exit $status
