#!/bin/bash
# A simulated two-node Slurm cluster on this machine (root; Debian's slurm-wlm 22.05 + munge):
#   eval "$(pipelines/slurm_sim.sh up DIR)"   install what is missing, start munge, slurmctld and
#                                            one slurmd per node; print the lines to eval
#   pipelines/slurm_sim.sh down DIR          stop all it started, remove the namespaces (also
#                                            after a failed up)
# The nodes are built as pipelines/netns_cluster.sh builds them (theanompi.launch.simcluster):
# one network namespace per node, each process there under its own host name (unshare --uts).
# Slurm's controller stays in the root namespace, on a bridge with one veth per node, so that
# sbatch/squeue/sacct work from this shell:
#   slurmhead 198.19.1.1 (bridge tmsl0, slurmctld)   nodeA 198.19.1.11   nodeB 198.19.1.12
# Jobs are submitted from this shell; each node has the machine's files (no shared-FS setup).
set -Eeuo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
NODES=(nodeA nodeB)
NS=(tmslA tmslB)              # not simcluster's tmpisim<pid>... names: its stale sweep skips them
ADDR=(198.19.1.11 198.19.1.12)
HEAD_ADDR=198.19.1.1
BRIDGE=tmsl0
ACTIVE=/run/theanompi-slurm-sim  # the DIR of the cluster up now: one at a time (port 6817)
CPUS=${SLURM_SIM_CPUS:-2}     # CPUs each simulated node offers (the ranks per node)
# cred_expire also sets how long a requeued job waits (Reason=BeginTime) before it may start
# again: 120 s by default, 5 s here (the least Slurm takes)
CRED_EXPIRE=${SLURM_SIM_CRED_EXPIRE:-5}
GRACE=${SLURM_SIM_GRACE:-30}  # s a preempted job has between SIGTERM and SIGKILL

usage() { echo "usage: $0 up DIR | down DIR" >&2; exit 2; }
say() { echo "slurm_sim: $*" >&2; }

install_missing() {
  local missing=()
  command -v slurmctld >/dev/null || missing+=(slurmctld)
  command -v slurmd >/dev/null || missing+=(slurmd)
  command -v sbatch >/dev/null || missing+=(slurm-client)
  command -v munged >/dev/null || missing+=(munge)
  [ ${#missing[@]} -eq 0 ] && return 0
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends "${missing[@]}" >&2 \
    || { apt-get update >&2 && apt-get install -y --no-install-recommends "${missing[@]}" >&2; }
}

write_config() {
  local dir=$1
  mkdir -p "$dir/ctld" "$dir/log"
  for n in "${NODES[@]}"; do mkdir -p "$dir/$n"; done
  cat >"$dir/slurm.conf" <<EOF
# written by pipelines/slurm_sim.sh
ClusterName=tmpisim
SlurmctldHost=slurmhead($HEAD_ADDR)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=$CRED_EXPIRE
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# this machine's cgroup tree is a tmpfs with v1 controllers: no cgroup plugins
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
# two nodes, one job at a time: a pass every 2 s (defaults 60 s and 30 s) starts a requeued
# job when its hold ends, not up to half a minute later
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# a node whose slurmd is gone is DOWN after 10 s, not 300: the elastic test takes one down, and
# its job (--no-kill) must go on, then end, without waiting minutes for the node's verdict
SlurmdTimeout=10
JobRequeue=1
KillWait=30
MinJobAge=600
# sacct --completion (-c) reads this file; no database
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/jobcomp.txt
AccountingStorageType=accounting_storage/none
NodeName=${NODES[0]} NodeAddr=${ADDR[0]} CPUs=$CPUS State=UNKNOWN
NodeName=${NODES[1]} NodeAddr=${ADDR[1]} CPUs=$CPUS State=UNKNOWN
# a shared cluster's preemption: a job in 'urgent' (the higher PriorityTier) takes the nodes of
# a 'sim' job, which gets SIGTERM, GraceTime s to stop, SIGKILL, and goes back to the queue
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=sim Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=$GRACE
PartitionName=urgent Nodes=${NODES[0]},${NODES[1]} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
EOF
  cat >"$dir/cgroup.conf" <<EOF
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
EOF
}

build_network() {
  ip link add "$BRIDGE" type bridge
  ip addr add "$HEAD_ADDR/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for i in 0 1; do
    local ns=${NS[$i]} host=${NS[$i]}h peer=${NS[$i]}n
    ip netns add "$ns"
    ip link add "$host" type veth peer name "$peer"
    ip link set "$host" master "$BRIDGE" up
    ip link set "$peer" netns "$ns"
    ip -n "$ns" addr add "${ADDR[$i]}/24" dev "$peer"
    ip -n "$ns" link set lo up
    ip -n "$ns" link set "$peer" up
  done
}

start_munge() {
  local dir=$1
  if munge -n </dev/null >/dev/null 2>&1; then return 0; fi
  [ -s /etc/munge/munge.key ] || { mungekey --create >&2 2>/dev/null || create-munge-key -f >&2; }
  chown munge:munge /etc/munge/munge.key 2>/dev/null || true
  mkdir -p /run/munge && chown munge:munge /run/munge
  if id munge >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged
  else
    /usr/sbin/munged --force
  fi
  touch "$dir/started-munge"
  for _ in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && return 0; sleep 0.1; done
  say "munged did not come up"; return 1
}

start_daemons() {
  local dir=$1
  # the controller: root namespace, under the host name its SlurmctldHost line gives it
  unshare --uts sh -c "hostname slurmhead && exec slurmctld -f $dir/slurm.conf"
  for i in 0 1; do
    ip netns exec "${NS[$i]}" unshare --uts sh -c \
      "hostname ${NODES[$i]} && SLURM_CONF=$dir/slurm.conf exec slurmd -f $dir/slurm.conf -N ${NODES[$i]}"
  done
  export SLURM_CONF=$dir/slurm.conf
  for _ in $(seq 150); do
    if [ "$(sinfo -h -N -p sim -o '%t' 2>/dev/null | grep -c '^idle')" = 2 ]; then return 0; fi
    sleep 0.2
  done
  say "the nodes did not come up idle: $(sinfo -N 2>&1 | tr '\n' ' ')"
  say "see $dir/log/"
  return 1
}

up() {
  local dir
  dir=$(mkdir -p "$1" && cd "$1" && pwd)
  [ "$(id -u)" = 0 ] || { say "needs root (network namespaces, slurmd)"; exit 2; }
  [ -s "$ACTIVE" ] && down "$(cat "$ACTIVE")" 2>/dev/null   # what a crashed run left
  down "$dir" 2>/dev/null || true
  install_missing
  write_config "$dir"
  echo "$dir" >"$ACTIVE"
  trap 'say "up failed; tearing down"; down "$dir" >/dev/null 2>&1 || true' ERR
  build_network
  start_munge "$dir"
  start_daemons "$dir"
  trap - ERR
  cat <<EOF
export SLURM_CONF=$dir/slurm.conf
export PATH=$REPO/.venv/bin:\$PATH
# 2 ranks per simulated node share this machine's cores: let waiting ranks yield
export OMPI_MCA_mpi_yield_when_idle=1
EOF
}

stop_pids() {  # SIGTERM to the daemons of these pid files, SIGKILL to those left after 5 s
  local pids=() f
  for f in "$@"; do
    [ -s "$f" ] && pids+=("$(cat "$f")")
    rm -f "$f"
  done
  [ ${#pids[@]} -eq 0 ] && return 0
  kill "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "${pids[@]}" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "${pids[@]}" 2>/dev/null || true
}

down() {
  local dir
  dir=$(cd "$1" 2>/dev/null && pwd || echo "$1")
  stop_pids "$dir/slurmd-${NODES[0]}.pid" "$dir/slurmd-${NODES[1]}.pid" "$dir/slurmctld.pid"
  for ns in "${NS[@]}"; do   # the jobs' processes left in the nodes, then the nodes
    if ip netns list 2>/dev/null | grep -qw "$ns"; then
      for _ in 1 2 3 4 5; do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        [ -z "$pids" ] && break
        kill -9 $pids 2>/dev/null || true
        sleep 0.1
      done
      ip netns del "$ns" 2>/dev/null || true
    fi
    ip link del "${ns}h" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  if [ -e "$dir/started-munge" ]; then
    stop_pids /run/munge/munged.pid
    rm -f "$dir/started-munge"
  fi
  [ "$(cat "$ACTIVE" 2>/dev/null)" = "$dir" ] && rm -f "$ACTIVE"
  say "down"
}

[ $# -eq 2 ] || usage
case "$1" in
  up) up "$2" ;;
  down) down "$2" ;;
  *) usage ;;
esac
