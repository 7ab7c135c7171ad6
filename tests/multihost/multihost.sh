#!/usr/bin/env bash
# Simulated hosts on one machine, each a network namespace with its own mount
# namespace and /dev/shm, joined by veth pairs on a bridge that lives in a
# namespace of its own ("the switch"). Addresses 10.213.0.10+i/24 exist only
# inside these namespaces; the machine's own interfaces, addresses and
# routes are never touched. Everything is made by this script and removed on
# exit. Hosts share the machine's file system (like a cluster's shared NFS),
# but each has /dev/shm of its own: DIR/hI/shm, bind-mounted, so that what a
# host leaves there can be checked after its processes are gone.
#
# Usage: multihost.sh BUILD_DIR CASE
#   dp_tp       2 hosts x 2 ranks, dtprun --nnodes 2: dp across hosts, tp
#               within, float64 parity with one device and the collective
#               counts of the same job on one host; hostnames that resolve to
#               loopback (as in containers), so Gloo takes the address on the
#               route to MASTER_ADDR
#   ifname      the same with GLOO_SOCKET_IFNAME=eth0, and with hostnames
#               h0/h1 that resolve to the hosts' addresses (c10d's default)
#   pp          pp across hosts, tp within
#   ckpt        saved on 2 hosts at (dp, tp) = (2, 2), resumed on 1 host at
#               tp 2: the losses continue as an uninterrupted run's
#   link_down   host 1's link is cut mid-training: every rank fails within
#               DTP_TIMEOUT_S naming ranks of the other host; no /dev/shm
#               leftovers on either host. Before the cut: each host's ranks
#               share their segments (the tp pair's, and the host's part of
#               the world group's two-level path), no segment spans the hosts
#               (host identity)
#   two_level   dp over 2 hosts x 2 ranks (FSDP, then DDP) on the two-level
#               path (DTP_TWO_LEVEL=1 says which groups take it) under
#               TORCH_DISTRIBUTED_DEBUG=DETAIL: float64 parity with one
#               device, the collective counts of the same job on one host
#   hsdp        HSDP (hsdp_train): fully_shard on (dp_replicate, dp_shard) =
#               (2, 2), one replica per host (dp_shard within, dp_replicate
#               across): float64 parity with one device, the closed-form
#               collectives of a step, the counts of the same job on one host
#   restart     dtprun --max-restarts 1 with --save/--resume across the hosts:
#               a rank SIGKILLed mid-training costs at most the steps since
#               the last complete save, and the losses after the restart
#               equal the uninterrupted run's
#   mpirun      Debian's mpirun (Open MPI) across the hosts: its ssh agent is
#               a script that runs Open MPI's daemon on host I as `on I`
#               does; ranks 0, 1 on h0 and 2, 3 on h1 with the local ranks
#               mpirun gives; dp across hosts, tp within: parity and counts
#   slurm       srun's environment (SLURM_PROCID, SLURM_LOCALID,
#               SLURM_STEP_NODELIST=h[0-1], SLURM_JOB_ID, no MASTER_ADDR/PORT)
#               across the hosts: dp across hosts, tp within, parity
#   slurmd      a real Slurm cluster of the test's own (Debian's slurm-wlm:
#               slurmctld on h0, slurmd on h0 and h1, auth/none, files under
#               the test's folder): `srun -N 2 --ntasks-per-node 2` places
#               tasks 0, 1 on h0 and 2, 3 on h1; dp across, tp within:
#               parity and counts
#   torchrun    torchrun --nnodes 2 with c10d rendezvous (where torchrun exists)
#   bench       not a test (no ctest entry, never asserts times): dtp-bench
#               --collectives on 2 hosts x 2 ranks, flat Gloo against the
#               two-level path, each host's eth0 shaped by tc netem (delay
#               DTP_NETEM_DELAY, default 50us each way, so 100 us round trip;
#               rate DTP_NETEM_RATE, default 10gbit), or where the kernel has
#               no netem by tbf (the rate only); sizes DTP_BENCH_BYTES
# Exit 77 (skipped) without root, ip netns or unshare.
set -uo pipefail
export LC_ALL=C
build=$(cd "$1" && pwd) case=$2
dtprun=$build/apps/dtprun/dtprun train=$build/apps/dtp-train
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

skip() { echo "multihost: SKIPPED: $*"; exit 77; }
fail() { echo "multihost $case: FAILED: $*"; exit 1; }
[ "$(id -u)" = 0 ] || skip "needs root for network namespaces (CI runs as root)"
command -v ip >/dev/null && command -v unshare >/dev/null || skip "needs ip (iproute2) and unshare (util-linux)"

W=$(mktemp -d /tmp/dtp-multihost.XXXXXX)
tag=dmh$$                 # namespace names of this run: dmh<pid>sw, dmh<pid>h0, ...
sw=${tag}sw
hosts=()
cleanup() {
  for ns in "${hosts[@]}" "$sw"; do
    # Processes left in a host (a failed case) go with it.
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null
  done
  [ -n "${DTP_MULTIHOST_KEEP:-}" ] && echo "multihost: kept $W" || rm -rf "$W"
}
trap cleanup EXIT

# make_hosts N: hosts h0..h(N-1) at 10.213.0.10+i, all on the switch's bridge.
make_hosts() {
  ip netns add "$sw" 2>/dev/null || skip "cannot create a network namespace (ip netns add)"
  # In a chroot whose / is not a mount point (scripts/debian13.sh's root),
  # ip netns add leaves a namespace it cannot enter.
  ip -n "$sw" link set lo up 2>/dev/null ||
    skip "cannot enter a network namespace made by ip netns add (a chroot without a mount of its own at /?)"
  ip -n "$sw" link add br0 type bridge && ip -n "$sw" link set br0 up || fail "cannot make the switch's bridge"
  : > "$W/hosts"
  echo "127.0.0.1 localhost" >> "$W/hosts"
  for ((i = 0; i < $1; i++)); do
    local ns=${tag}h$i
    ip netns add "$ns" || fail "ip netns add $ns"
    hosts+=("$ns")
    ip -n "$sw" link add "p$i" type veth peer name eth0 netns "$ns" || fail "veth for host $i"
    ip -n "$sw" link set "p$i" master br0 up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "10.213.0.$((10 + i))/24" dev eth0
    ip -n "$ns" link set eth0 up
    mkdir -p "$W/h$i/shm"
    echo "10.213.0.$((10 + i)) h$i" >> "$W/hosts"
  done
  # Each host reaches the others (the bridge may take a moment to forward).
  for ((i = 1; i < $1; i++)); do
    for t in 1 2 3 4 5 6 7 8 9 10; do on 0 ping -c1 -W1 "10.213.0.$((10 + i))" >/dev/null 2>&1 && break; sleep 0.5; done
  done
}

# on I CMD...: CMD on host I, in a mount namespace of its own with DIR/hI/shm
# as /dev/shm. With NAMED=1, also a UTS namespace with hostname hI and the
# hosts' /etc/hosts (hI resolves to its address); otherwise the machine's
# hostname, which (in containers and on Debian) resolves to loopback.
on() {
  local i=$1
  shift
  local uts=() named=${NAMED:-0}
  [ "$named" = 1 ] && uts=(-u)
  ip netns exec "${tag}h$i" unshare -m "${uts[@]}" --propagation private -- bash -c '
    mount --bind "$1/h$2/shm" /dev/shm || exit 98
    if [ "$3" = 1 ]; then mount --bind "$1/hosts" /etc/hosts && hostname "h$2" || exit 98; fi
    shift 3; exec "$@"' _ "$W" "$i" "$named" "$@"
}

common="--dim 32 --seq 16 --kv-heads 2 --layers 2 --dtype float64 --log-every 1"
master=10.213.0.10
# A job of 2 hosts x 2 ranks through dtprun; output in DIR/NAME.h0/.h1.
two_hosts() {
  local name=$1
  shift
  on 1 "$dtprun" --nnodes 2 --node-rank 1 --master-addr $master --master-port 29500 -n 2 "$@" > "$W/$name.h1" 2>&1 &
  local h1=$!
  on 0 "$dtprun" --nnodes 2 --node-rank 0 --master-addr $master --master-port 29500 -n 2 "$@" > "$W/$name.h0" 2>&1
  local s0=$?
  wait $h1
  local s1=$?
  [ $s0 = 0 ] && [ $s1 = 0 ] || { cat "$W/$name.h0" "$W/$name.h1"; fail "$name: exit status $s0 (host 0), $s1 (host 1)"; }
}
collectives() { grep -o '\[rank 0\] done: .*' "$1" | sed 's/.*tok\/s, //'; }
parity() {
  grep -E '^(\[rank 0\] )?parity vs one device in float64 .*: ok' "$1" || { cat "$1"; fail "$2: no float64 parity line"; }
}
no_leftovers() {
  for ((i = 0; i < ${#hosts[@]}; i++)); do
    [ -z "$(ls -A "$W/h$i/shm")" ] || fail "host $i left in /dev/shm: $(ls -A "$W/h$i/shm")"
  done
  echo "no /dev/shm leftovers on ${#hosts[@]} hosts"
}
# Same job, same counts: the reference on one host (4 local ranks).
same_counts_as_one_host() {
  local name=$1
  shift
  on 0 "$dtprun" -n 4 "$@" > "$W/$name.one" 2>&1 || { cat "$W/$name.one"; fail "$name on one host"; }
  local want got
  want=$(collectives "$W/$name.one") got=$(collectives "$W/$name.h0")
  [ -n "$want" ] && [ "$want" = "$got" ] || fail "$name: collectives on 2 hosts '$got', on one host '$want'"
  echo "$name: collectives as on one host: $got"
}

case $case in
dp_tp)
  make_hosts 2
  args=("$train" $common --steps 3 --dp 2 --tp 2 --check-parity)
  two_hosts dp_tp "${args[@]}"
  parity "$W/dp_tp.h0" dp_tp
  # The hostname resolves to loopback here: said once per host, with the choice.
  for i in 0 1; do
    grep -q "Gloo binds to 10.213.0.1$i, this host's address on the route to MASTER_ADDR=$master" "$W/dp_tp.h$i" ||
      { cat "$W/dp_tp.h$i"; fail "host $i did not say which address Gloo took"; }
  done
  same_counts_as_one_host dp_tp "${args[@]}"
  no_leftovers
  ;;
ifname)
  make_hosts 2
  GLOO_SOCKET_IFNAME=eth0 two_hosts ifname "$train" $common --steps 2 --dp 2 --tp 2 --check-parity
  parity "$W/ifname.h0" "GLOO_SOCKET_IFNAME=eth0"
  ! grep -q "Gloo binds to" "$W/ifname.h0" || fail "GLOO_SOCKET_IFNAME set, yet dtp guessed"
  NAMED=1 two_hosts named "$train" $common --steps 2 --dp 2 --tp 2 --check-parity
  parity "$W/named.h0" "hostnames h0/h1"
  ! grep -q "Gloo binds to" "$W/named.h0" || fail "the hostname resolves to the host's address, yet dtp guessed"
  # A wrong interface is named before any connection.
  GLOO_SOCKET_IFNAME=eth9 on 0 env RANK=0 WORLD_SIZE=2 MASTER_ADDR=$master "$train" $common --steps 1 > "$W/bad" 2>&1 &&
    fail "GLOO_SOCKET_IFNAME=eth9 was accepted"
  grep -q "GLOO_SOCKET_IFNAME names interface 'eth9': got no such interface on this host, expected one of lo, eth0" "$W/bad" ||
    { cat "$W/bad"; fail "GLOO_SOCKET_IFNAME=eth9: no error naming it"; }
  echo "GLOO_SOCKET_IFNAME=eth9 is refused naming lo, eth0"
  ;;
pp)
  make_hosts 2
  args=("$train" $common --steps 3 --pp 2 --tp 2 --check-parity)
  two_hosts pp "${args[@]}"
  parity "$W/pp.h0" pp
  same_counts_as_one_host pp "${args[@]}"
  ;;
ckpt)
  make_hosts 2
  losses() { grep -E '^\[rank 0\] step +[0-9]+  loss' "$1" | sed 's/ *[0-9.]* tok.*//'; }
  on 0 "$dtprun" -n 2 "$train" $common --steps 6 --tp 2 > "$W/want" 2>&1 || { cat "$W/want"; fail "reference run"; }
  two_hosts save "$train" $common --steps 3 --dp 2 --tp 2 --save "$W/ckpt"
  [ -e "$W/ckpt/step-3/index.json" ] || fail "no $W/ckpt/step-3/index.json after the 2-host save: $(ls -R "$W/ckpt")"
  on 1 "$dtprun" -n 2 "$train" $common --steps 6 --tp 2 --resume "$W/ckpt" > "$W/resume" 2>&1 || { cat "$W/resume"; fail "resume on host 1"; }
  grep -q "resuming from $W/ckpt/step-3" "$W/resume" || { cat "$W/resume"; fail "did not resume from step-3"; }
  diff <(losses "$W/want" | grep -E 'step +[4-6] ') <(losses "$W/resume") || fail "losses after resuming differ"
  echo "saved on 2 hosts at (dp, tp) = (2, 2), resumed on 1 host at tp 2: steps 4-6 equal the uninterrupted run"
  ;;
link_down)
  make_hosts 2
  timeout_s=8
  export DTP_TIMEOUT_S=$timeout_s
  on 1 "$dtprun" --nnodes 2 --node-rank 1 --master-addr $master --master-port 29500 -n 2 "$train" $common \
    --steps 100000 --dp 2 --tp 2 > "$W/ld.h1" 2>&1 &
  h1=$!
  on 0 "$dtprun" --nnodes 2 --node-rank 0 --master-addr $master --master-port 29500 -n 2 "$train" $common \
    --steps 100000 --dp 2 --tp 2 > "$W/ld.h0" 2>&1 &
  h0=$!
  for t in $(seq 1 300); do grep -q 'step    20 ' "$W/ld.h0" && break; sleep 0.1; done
  grep -q 'step    20 ' "$W/ld.h0" || { cat "$W/ld.h0" "$W/ld.h1"; fail "training did not reach step 20"; }
  # Host identity: each rank maps two segments, its tp pair's and its host's
  # part of the world group's (two-level: NOTE: [Two-level collectives]);
  # ranks 0, 1 share theirs, ranks 2, 3 theirs, and no segment spans the
  # hosts (one of the other host's /dev/shm cannot be opened). The dp groups,
  # one rank per host, have none.
  for i in 0 1; do
    for p in $(ip netns pids ${tag}h$i); do
      r=$(tr '\0' '\n' < /proc/$p/environ 2>/dev/null | sed -n 's/^RANK=//p')
      [ -n "$r" ] && echo "$r $(grep -o 'dtp-[0-9]*-[0-9a-f]*' /proc/$p/maps | sort -u | tr '\n' ' ')"
    done
  done | sort > "$W/segments"
  cat "$W/segments"
  [ "$(wc -l < "$W/segments")" = 4 ] || fail "expected 4 ranks' mappings, got: $(cat "$W/segments")"
  seg() { awk -v r=$1 '$1 == r { $1 = ""; print }' "$W/segments" | xargs; }
  for r in 0 1 2 3; do
    [ "$(seg $r | wc -w)" = 2 ] || fail "rank $r maps $(seg $r | wc -w) segments, expected 2 (its tp group's, its host's part of the world group's)"
  done
  [ "$(seg 0)" = "$(seg 1)" ] && [ "$(seg 2)" = "$(seg 3)" ] &&
    [ -z "$(comm -12 <(seg 0 | tr ' ' '\n' | sort) <(seg 2 | tr ' ' '\n' | sort))" ] ||
    fail "ranks 0, 1 and ranks 2, 3 should each share their host's segments, none across: $(cat "$W/segments")"
  ip -n "$sw" link set p1 down  # host 1's cable, pulled at the switch
  cut=$(date +%s.%N)
  wait $h0; s0=$?
  t0=$(date +%s.%N)
  wait $h1; s1=$?
  t1=$(date +%s.%N)
  echo "host 0 exited with $s0 after $(echo "$t0 - $cut" | bc) s, host 1 with $s1 after $(echo "$t1 - $cut" | bc) s"
  [ $s0 != 0 ] && [ $s1 != 0 ] || fail "a host exited 0 after its link went down"
  for t in "$t0" "$t1"; do
    (( $(echo "$t - $cut < $timeout_s + 6" | bc) )) || fail "a host took $(echo "$t - $cut" | bc) s, over DTP_TIMEOUT_S=$timeout_s s + 6"
  done
  # Each host names ranks of the other as the ones that did not arrive.
  grep -E 'failed: global ranks? [23].* did not reach it' "$W/ld.h0" | head -2
  grep -qE 'failed: global ranks? [23].* did not reach it' "$W/ld.h0" || { cat "$W/ld.h0"; fail "host 0 did not name rank 2 or 3"; }
  # Host 1 cannot reach the store on host 0 either: it names who it could not ask about.
  named1='failed: (global ranks? [01].* did not reach it|the job.s store \(served by global rank 0\) did not answer, so rank 0 exited or its host is unreachable; not known whether global ranks? [01])'
  grep -E "$named1" "$W/ld.h1" | head -2
  grep -qE "$named1" "$W/ld.h1" || { cat "$W/ld.h1"; fail "host 1 did not name rank 0 or 1"; }
  no_leftovers
  ;;
restart)
  make_hosts 2
  losses() { grep -E '^\[rank 0\] step +[0-9]+  loss' "$1" | sed 's/ *[0-9.]* tok.*//'; }
  args=("$train" $common --steps 14 --dp 2 --tp 2)
  two_hosts want "${args[@]}"
  losses "$W/want.h0" > "$W/want"
  # The same job under --max-restarts 1, saving every 2 steps; rank 3 (host 1)
  # is SIGKILLed once step 7 was logged.
  for i in 1 0; do
    on $i "$dtprun" --nnodes 2 --node-rank $i --master-addr $master --master-port 29500 -n 2 --max-restarts 1 \
      "${args[@]}" --save "$W/ck" --save-every 2 --resume "$W/ck" > "$W/rs.h$i" 2>&1 &
    eval "pid$i=\$!"
  done
  for t in $(seq 1 600); do grep -q 'step     7 ' "$W/rs.h0" && break; sleep 0.05; done
  grep -q 'step     7 ' "$W/rs.h0" || { cat "$W/rs.h0" "$W/rs.h1"; fail "training did not reach step 7"; }
  victim=""
  for p in $(ip netns pids ${tag}h1); do
    tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx 'RANK=3' && victim=$p
  done
  [ -n "$victim" ] || fail "rank 3's process not found on host 1"
  kill -9 "$victim"
  killed=$(date +%s.%N)
  last=$(losses "$W/rs.h0" | tail -1 | awk '{print $4}')
  # Recovery: from the kill to the first step logged after the restart.
  for t in $(seq 1 1200); do
    sed -n '/restarting all/,$p' "$W/rs.h0" | grep -qE '^\[rank 0\] step ' && break
    sleep 0.05
  done
  recovered=$(date +%s.%N)
  wait $pid0; s0=$?
  wait $pid1; s1=$?
  [ $s0 = 0 ] && [ $s1 = 0 ] || { cat "$W/rs.h0" "$W/rs.h1"; fail "exit status $s0 (host 0), $s1 (host 1) after the restart"; }
  grep -q 'restarting all 2 ranks of this machine (restart 1 of 1, master port 29501)' "$W/rs.h1" || fail "host 1 did not restart"
  grep -q 'restarting all 2 ranks of this machine (restart 1 of 1, master port 29501)' "$W/rs.h0" || fail "host 0 did not restart"
  from=$(grep -oE 'resuming from .*/step-[0-9]+' "$W/rs.h0" | grep -oE '[0-9]+$')
  [ -n "$from" ] || { cat "$W/rs.h0"; fail "the restarted job did not resume"; }
  echo "rank 3 SIGKILLed after step $last was logged; resumed from step-$from ($((last - from)) steps lost, --save-every 2);" \
    "first step again $(echo "$recovered - $killed" | bc | sed 's/^\./0./') s after the kill"
  (( last - from <= 3 )) || fail "lost $((last - from)) steps: more than --save-every 2 and the save in flight"
  # After the restart, steps from+1..14 as the uninterrupted run's.
  sed -n '/restarting all/,$p' "$W/rs.h0" > "$W/rs.after"
  diff <(grep -E "step +($(seq -s '|' $((from + 1)) 14)) " "$W/want") <(losses "$W/rs.after") ||
    fail "losses after the restart differ from the uninterrupted run's"
  echo "steps $((from + 1))-14 after the restart equal the uninterrupted run's"
  ;;
two_level)
  make_hosts 2
  # dp over all 4 ranks: the dp group (and the world) spans both hosts with 2
  # ranks on each, so it takes the two-level path; FSDP all-gathers and
  # reduce-scatters, DDP all-reduces.
  for mode in fsdp ddp; do
    args=("$train" $common --steps 3 --dp 4 --$mode --check-parity)
    DTP_TWO_LEVEL=1 TORCH_DISTRIBUTED_DEBUG=DETAIL two_hosts tl_$mode "${args[@]}"
    parity "$W/tl_$mode.h0" "two-level $mode"
    grep -q 'two-level collectives for global ranks \[0, 1, 2, 3\] over 2 hosts (leaders: global ranks \[0, 2\])' "$W/tl_$mode.h0" ||
      { cat "$W/tl_$mode.h0"; fail "$mode: the 4 ranks' group did not take the two-level path"; }
    same_counts_as_one_host tl_$mode "${args[@]}"
  done
  no_leftovers
  ;;
hsdp)
  make_hosts 2
  DTP_TWO_LEVEL=1 two_hosts hsdp "$build/tests/multihost/hsdp_train"
  parity "$W/hsdp.h0" hsdp
  grep -E '^\[rank 0\] step 2 forward\+backward: .*: ok' "$W/hsdp.h0" || { cat "$W/hsdp.h0"; fail "hsdp: collectives of step 2"; }
  same_counts_as_one_host hsdp "$build/tests/multihost/hsdp_train"
  no_leftovers
  ;;
mpirun)
  command -v mpirun >/dev/null || skip "mpirun is not installed (Debian's openmpi-bin)"
  # The agent and MCA names below are Open MPI 4's (Debian 12); 5 (PRRTE) renamed them: untested.
  mpirun --version 2>&1 | grep -q 'Open MPI) 4\.' || skip "tested with Open MPI 4 only; here: $(mpirun --version 2>&1 | head -1)"
  make_hosts 2
  export NAMED=1
  # mpirun's "ssh" (plm_rsh_agent): `agent hI CMD` runs CMD, Open MPI's
  # daemon, on simulated host I as `on I` would (its own /dev/shm, hostname
  # hI), through a shell as sshd does.
  cat > "$W/agent" <<AGENT
#!/bin/bash
host=\$1; shift
exec ip netns exec ${tag}\$host unshare -m -u --propagation private -- bash -c '
  mount --bind "$W/\$0/shm" /dev/shm && mount --bind "$W/hosts" /etc/hosts && hostname "\$0" || exit 98
  eval "\$1"' "\$host" "\$*"
AGENT
  chmod +x "$W/agent"
  printf 'h0 slots=2\nh1 slots=2\n' > "$W/hostfile"
  mpi=(mpirun --allow-run-as-root --hostfile "$W/hostfile" -np 4 --map-by slot --mca plm_rsh_agent "$W/agent"
       --mca oob_tcp_if_include eth0 --mca btl self,tcp --mca btl_tcp_if_include eth0
       -x MASTER_ADDR=$master -x MASTER_PORT=29500 -x OMP_NUM_THREADS=1 -x PATH)
  # Where mpirun put each rank, and what it told it: ranks 0, 1 on h0 and 2, 3 on h1, local ranks 0, 1.
  on 0 "${mpi[@]}" bash -c 'echo "rank $OMPI_COMM_WORLD_RANK of $OMPI_COMM_WORLD_SIZE on $(hostname), local rank $OMPI_COMM_WORLD_LOCAL_RANK"' \
    2>&1 | sort > "$W/mpirun.where"
  cat "$W/mpirun.where"
  diff "$W/mpirun.where" <(for r in 0 1 2 3; do echo "rank $r of 4 on h$((r / 2)), local rank $((r % 2))"; done) ||
    fail "mpirun did not place ranks 0, 1 on h0 and 2, 3 on h1"
  on 0 "${mpi[@]}" "$train" $common --steps 3 --dp 2 --tp 2 --check-parity > "$W/mpirun.out" 2>&1 ||
    { cat "$W/mpirun.out"; fail "mpirun across 2 hosts"; }
  parity "$W/mpirun.out" mpirun
  # Rank 0's collective counts (mpirun prefixes nothing) as the same job's on one host.
  grep -o 'done: .*' "$W/mpirun.out" | sed 's/^/[rank 0] /' > "$W/mpirun.h0"
  same_counts_as_one_host mpirun "$train" $common --steps 3 --dp 2 --tp 2 --check-parity
  no_leftovers
  ;;
slurm)
  make_hosts 2
  export NAMED=1
  # 29500 taken on host 0: a rank that ignored SLURM_JOB_ID would fail there.
  on 0 python3 -c 'import socket, time; s = socket.socket(); s.bind(("0.0.0.0", 29500)); s.listen(); time.sleep(120)' &
  blocker=$!
  sleep 0.3
  # What srun gives each task of `srun -N 2 --ntasks-per-node 2` in job 4242.
  for i in 1 0; do
    for l in 0 1; do
      on $i env SLURM_PROCID=$((2 * i + l)) SLURM_NTASKS=4 SLURM_LOCALID=$l SLURM_NODEID=$i SLURM_JOB_ID=4242 \
        SLURM_STEP_NODELIST='h[0-1]' SLURM_JOB_NODELIST='h[0-1]' OMP_NUM_THREADS=1 \
        "$train" $common --steps 3 --dp 2 --tp 2 --check-parity > "$W/slurm.$i$l" 2>&1 &
      eval "pid$i$l=\$!"
    done
  done
  for p in $pid00 $pid01 $pid10 $pid11; do wait $p || { cat "$W"/slurm.*; fail "a task failed"; }; done
  parity "$W/slurm.00" slurm
  kill $blocker
  echo "srun's environment across 2 hosts: MASTER_ADDR h0 from SLURM_STEP_NODELIST, MASTER_PORT 19242 from SLURM_JOB_ID"
  ;;
slurmd)
  for c in slurmctld slurmd srun sinfo; do command -v $c >/dev/null || skip "$c is not installed (Debian's slurm-wlm)"; done
  # auth/none and the cgroup stand-in below are what Slurm 22.05 (Debian 12) needs; later releases untested.
  slurmd -V | grep -q '^slurm[-a-z]* 22\.' || skip "tested with Slurm 22.05 only; here: $(slurmd -V)"
  make_hosts 2
  export NAMED=1
  # A cluster of this test's own: slurmctld on h0, one slurmd per host, all
  # state, spool, pid and log files under $W; no munge (auth/none).
  mkdir -p "$W/slurm"
  export SLURM_CONF=$W/slurm/slurm.conf
  cat > "$SLURM_CONF" <<CONF
ClusterName=dtpmh
SlurmctldHost=h0(10.213.0.10)
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$W/slurm/state
SlurmdSpoolDir=$W/slurm/spool-%n
SlurmctldPidFile=$W/slurm/slurmctld.pid
SlurmdPidFile=$W/slurm/slurmd-%n.pid
SlurmctldLogFile=$W/slurm/slurmctld.log
SlurmdLogFile=$W/slurm/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/linear
NodeName=h0 NodeAddr=10.213.0.10 CPUs=2 State=UNKNOWN
NodeName=h1 NodeAddr=10.213.0.11 CPUs=2 State=UNKNOWN
PartitionName=all Nodes=h0,h1 Default=YES MaxTime=INFINITE State=UP
CONF
  on 0 slurmctld -D -i > "$W/slurm/ctld.out" 2>&1 &
  sleep 1
  # slurmd looks for cgroups at start-up even with proctrack/linuxproc and
  # task/none (nothing here uses them), and `ip netns exec` left this host a
  # /sys of its own without them: a tmpfs at /sys/fs/cgroup with the freezer
  # and systemd (v1) hierarchies under it.
  for i in 0 1; do
    mkdir -p "$W/slurm/spool-h$i"
    on $i bash -c 'mount -t tmpfs none /sys/fs/cgroup && mkdir /sys/fs/cgroup/freezer /sys/fs/cgroup/systemd &&
      mount -t cgroup -o freezer none /sys/fs/cgroup/freezer &&
      mount -t cgroup -o none,name=systemd none /sys/fs/cgroup/systemd && exec slurmd -D -N "$0"' h$i > "$W/slurm/d$i.out" 2>&1 &
  done
  for t in $(seq 1 60); do [ "$(on 0 sinfo -h -o '%T %D' 2>/dev/null)" = "idle 2" ] && break; sleep 0.5; done
  [ "$(on 0 sinfo -h -o '%T %D' 2>/dev/null)" = "idle 2" ] ||
    { on 0 sinfo; cat "$W"/slurm/*.out "$W"/slurm/*.log; fail "the 2 slurmd did not come up idle"; }
  on 0 sinfo -N -o '%N %T %c'
  on 0 srun -N 2 --ntasks-per-node 2 bash -c 'echo "task $SLURM_PROCID of $SLURM_NTASKS on $(hostname), local $SLURM_LOCALID, nodes $SLURM_STEP_NODELIST"' |
    sort | tee "$W/srun.where"
  diff "$W/srun.where" <(for r in 0 1 2 3; do echo "task $r of 4 on h$((r / 2)), local $((r % 2)), nodes h[0-1]"; done) ||
    fail "srun did not place tasks 0, 1 on h0 and 2, 3 on h1"
  # No MASTER_ADDR/MASTER_PORT: the ranks take h0 from SLURM_STEP_NODELIST and a port from SLURM_JOB_ID.
  on 0 srun -N 2 --ntasks-per-node 2 "$train" $common --steps 3 --dp 2 --tp 2 --check-parity > "$W/srun.out" 2>&1 ||
    { cat "$W/srun.out" "$W"/slurm/*.log; fail "srun -N 2 across the hosts"; }
  parity "$W/srun.out" "srun -N 2"
  grep -o 'done: .*' "$W/srun.out" | sed 's/^/[rank 0] /' > "$W/srun.h0"
  NAMED=0 same_counts_as_one_host srun "$train" $common --steps 3 --dp 2 --tp 2 --check-parity
  no_leftovers
  ;;
torchrun)
  command -v torchrun >/dev/null || skip "torchrun is not installed (Debian's python3-torch)"
  # torchrun's own interpreter (a python3 earlier on PATH may lack torch).
  py=$(sed -n '1s/^#! *//p' "$(command -v torchrun)")
  # 2.x built without libuv (Debian 13) needs the wrapper; 1.13 (Debian 12) has no libuv option at all.
  if "$py" -c 'import sys, torch; sys.exit(int(torch.__version__.split(".")[0]) < 2)'; then
    launcher=("$py" "$here/../multiprocess/torchrun_nolibuv.py")
  else
    # 1.13 under Python 3.11: Std.from_str finds only single-bit members
    # (3.11 iterates an IntFlag's canonical members: not NONE = 0, not
    # ALL = 3), so torchrun's defaults --redirects 0 --tee 0 fail before any
    # rank starts; stdout goes to a file and is teed back (1 = OUT).
    launcher=(torchrun --redirects 1 --tee 1 --log_dir "$W/torchrun-logs")
  fi
  echo "torchrun: torch $("$py" -c 'import torch; print(torch.__version__)') (${launcher[*]})"
  make_hosts 2
  # torchrun's agents advertise their hostnames: h0/h1, resolving to the hosts' addresses.
  export NAMED=1
  for i in 1 0; do
    on $i "${launcher[@]}" --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d \
      --rdzv_endpoint $master:29400 --rdzv_id dtp --no_python "$train" $common --steps 3 --dp 2 --tp 2 --check-parity \
      > "$W/torchrun.h$i" 2>&1 &
    eval "pid$i=\$!"
  done
  wait $pid0 && wait $pid1 || { cat "$W"/torchrun.*; fail "torchrun across 2 hosts"; }
  grep -E 'parity vs one device in float64 .*: ok' "$W"/torchrun.h* || { cat "$W"/torchrun.*; fail "no parity line"; }
  ;;
bench)
  command -v tc >/dev/null || skip "needs tc (iproute2)"
  make_hosts 2
  delay=${DTP_NETEM_DELAY:-50us} rate=${DTP_NETEM_RATE:-10gbit}
  shaped="netem delay $delay rate $rate"
  for i in 0 1; do
    if ! ip netns exec ${tag}h$i tc qdisc add dev eth0 root netem delay "$delay" rate "$rate" 2> "$W/tc.err"; then
      # Kernels built without CONFIG_NET_SCH_NETEM (Firecracker's) have no
      # delay qdisc at all: the rate alone, through tbf (burst above a GSO
      # packet of 64 KiB), and the veth's own latency.
      grep -q 'qdisc kind is unknown' "$W/tc.err" || fail "tc netem on host $i: $(cat "$W/tc.err")"
      ip netns exec ${tag}h$i tc qdisc add dev eth0 root tbf rate "$rate" burst 1mb latency 5ms || fail "tc tbf on host $i"
      shaped="tbf rate $rate, no added delay (this kernel has no netem)"
    fi
  done
  echo "each host's eth0: $shaped"
  command -v ping >/dev/null && echo "host 0 -> host 1: $(on 0 ping -q -c 20 -i 0.05 10.213.0.11 | tail -1)"
  # shellcheck disable=SC2086
  two_hosts bench "$build/apps/dtp-bench" --collectives --bytes ${DTP_BENCH_BYTES:-1024 16384 262144 1048576 4194304 16777216}
  sed -n 's/^\[rank 0\] //p' "$W/bench.h0"
  ;;
*)
  fail "unknown case '$case'"
  ;;
esac
echo "multihost $case: ok"
