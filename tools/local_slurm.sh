#!/usr/bin/env bash
# A real Slurm cluster on this one machine: munged, slurmctld and N slurmd "nodes" (n1, n2, ...), loopback only,
# every file (config, keys, state, spool, logs, pids) in one directory. For trying sbatch scripts and for the tests.
#
#   eval "$(tools/local_slurm.sh start)"        # prints `export SLURM_CONF=... LOCAL_SLURM_DIR=...`; waits until idle
#   sbatch -p debug launch/slurm/train.sbatch ...
#   tools/local_slurm.sh status
#   tools/local_slurm.sh stop                   # cancels jobs, stops the daemons by PID, removes nothing
#
# start options: --dir DIR (default: a new mktemp dir), --nodes N (2), --cpus C per node (2),
#                --gpus G per node (0; G>0 declares gres gpu:G backed by placeholder device files, so that
#                --gpus-per-node is accepted; there is no GPU behind them),
#                --owner-pid PID (stop the cluster by itself once PID is gone: tests pass their own PID).
# stop/status take --dir DIR or use $LOCAL_SLURM_DIR.
#
# Needs root and Slurm (tools/install_slurm.sh). Every slurmd runs in its own mount + UTS namespace
# (unshare -m -u): a private /etc/hosts (bind mount) makes n1..nN resolve to 127.0.0.1 and `hostname` says the
# node's name, so jobs see what they would on a real cluster (scontrol show hostnames, torchrun rendezvous on the
# first node). The namespaces vanish with their processes; nothing on the host is changed.
set -euo pipefail

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

cmd=${1:-}; [[ -n $cmd ]] || usage 1; shift
dir=${LOCAL_SLURM_DIR:-}; nodes=2; cpus=2; gpus=0; owner=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --dir) dir=$2; shift 2 ;;
    --nodes) nodes=$2; shift 2 ;;
    --cpus) cpus=$2; shift 2 ;;
    --gpus) gpus=$2; shift 2 ;;
    --owner-pid) owner=$2; shift 2 ;;
    -h|--help) usage 0 ;;
    *) echo "local_slurm: unknown option $1" >&2; usage 1 ;;
  esac
done

log() { echo "local_slurm: $*" >&2; }
die() { log "$*"; exit 1; }

free_ports() {  # N free TCP ports on the loopback
  python3 - "$1" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

# ---- stop: jobs first (their slurmstepds belong to the nodes), then the daemons, each by the PID we recorded
stop_cluster() {
  [[ -n $dir && -d $dir ]] || die "no cluster dir: pass --dir DIR or set LOCAL_SLURM_DIR"
  [[ -f $dir/pids ]] || { log "nothing started in $dir"; return 0; }
  if [[ -f $dir/watchdog.pid ]]; then  # not when the watchdog itself is stopping the cluster
    local watchdog; watchdog=$(cat "$dir/watchdog.pid")
    [[ $watchdog == "$PPID" ]] || kill -TERM "$watchdog" 2>/dev/null || true
    rm -f "$dir/watchdog.pid"
  fi
  export SLURM_CONF=$dir/slurm.conf
  if timeout 10 scancel --quiet --user="$(id -un)" 2>/dev/null; then
    for _ in $(seq 50); do
      [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break
      sleep 0.2
    done
  fi
  # slurmds, then slurmctld, then munged (reverse start order)
  local pids; pids=$(tac "$dir/pids" | awk '{print $2}')
  for pid in $pids; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in $pids; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then log "pid $pid ignored SIGTERM; SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; fi
  done
  mv "$dir/pids" "$dir/pids.stopped"
  log "stopped ($dir)"
}

status_cluster() {
  [[ -n $dir && -d $dir ]] || die "no cluster dir: pass --dir DIR or set LOCAL_SLURM_DIR"
  export SLURM_CONF=$dir/slurm.conf
  if [[ -f $dir/pids ]]; then
    while read -r name pid; do
      if kill -0 "$pid" 2>/dev/null; then echo "$name pid $pid running"; else echo "$name pid $pid DEAD"; fi
    done < "$dir/pids"
    sinfo -N -o '%N %T %c %G' || true
    squeue || true
  else
    echo "not running ($dir)"
  fi
}

start_cluster() {
  [[ $(id -u) == 0 ]] || die "needs root (slurmd and munged run as root here)"
  for b in munged slurmctld slurmd sbatch unshare; do
    command -v "$b" >/dev/null || [[ -x /usr/sbin/$b ]] || die "$b not found: run tools/install_slurm.sh"
  done
  [[ $nodes -ge 1 ]] || die "--nodes must be >= 1"
  if [[ -z $dir ]]; then dir=$(mktemp -d /tmp/local-slurm.XXXXXX); fi
  mkdir -p "$dir"; dir=$(cd "$dir" && pwd)
  [[ ! -f $dir/pids ]] || die "a cluster is already running from $dir (stop it first)"
  export PATH=$PATH:/usr/sbin
  chmod 700 "$dir"
  mkdir -p "$dir/munge" "$dir/ctld" "$dir/log" "$dir/dev"
  chmod 700 "$dir/munge"
  : > "$dir/pids"
  # If anything below fails, stop what did start.
  trap 'log "start failed; logs in $dir/log"; stop_cluster || true' ERR

  # munge: our own key and socket; slurm finds the socket through AuthInfo.
  head -c 1024 /dev/urandom > "$dir/munge/munge.key"; chmod 600 "$dir/munge/munge.key"
  munged --foreground --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed" \
    >>"$dir/log/munged.out" 2>&1 &
  echo "munged $!" >> "$dir/pids"

  local ports; read -r -a ports <<< "$(free_ports $((nodes + 1)))"
  local host; host=$(hostname -s)
  {
    echo "127.0.0.1 localhost $host"
    for i in $(seq "$nodes"); do echo "127.0.0.1 n$i"; done
  } > "$dir/hosts"

  local gres_node="" gres_types=""
  if [[ $gpus -gt 0 ]]; then
    gres_types="GresTypes=gpu"; gres_node="Gres=gpu:$gpus"
    : > "$dir/gres.conf"
    for i in $(seq "$nodes"); do
      local files=()
      for g in $(seq 0 $((gpus - 1))); do
        # char device 1:3 (like /dev/null): slurm only needs a device file per GPU to hand out
        [[ -e $dir/dev/n$i-gpu$g ]] || mknod "$dir/dev/n$i-gpu$g" c 1 3
        files+=("$dir/dev/n$i-gpu$g")
      done
      echo "NodeName=n$i Name=gpu File=$(IFS=,; echo "${files[*]}")" >> "$dir/gres.conf"
    done
  fi

  cat > "$dir/slurm.conf" <<EOF
# Written by tools/local_slurm.sh: a loopback-only cluster, all state under $dir
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=${ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=5: a requeued batch job may start again ~6 s later (the default 120 s is far too long for tests)
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=5
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# nodes may declare more CPUs/GPUs than this machine has
SlurmdParameters=config_overrides
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
SchedulerParameters=bf_interval=1,sched_interval=2
ReturnToService=2
JobRequeue=1
# 0: finished jobs stay visible to scontrol, and sbatch --wait polls every 2 s (it backs off to 32 s otherwise)
MinJobAge=0
KillWait=10
InactiveLimit=0
MailProg=/bin/true
$gres_types
EOF
  for i in $(seq "$nodes"); do
    echo "NodeName=n$i NodeAddr=127.0.0.1 NodeHostname=n$i Port=${ports[$i]} CPUs=$cpus RealMemory=4000 $gres_node State=UNKNOWN" \
      >> "$dir/slurm.conf"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$dir/slurm.conf"

  slurmctld -D -i -f "$dir/slurm.conf" >>"$dir/log/slurmctld.out" 2>&1 &
  echo "slurmctld $!" >> "$dir/pids"
  for i in $(seq "$nodes"); do
    mkdir -p "$dir/spool/n$i"
    # unshare execs sh, which execs slurmd: $! is slurmd's PID.
    # shellcheck disable=SC2016  # expanded by the inner sh
    unshare -m -u --propagation private sh -c \
      'mount --bind "$1/hosts" /etc/hosts && hostname "$2" && exec slurmd -D -N "$2" -f "$1/slurm.conf"' \
      sh "$dir" "n$i" >>"$dir/log/slurmd.n$i.out" 2>&1 &
    echo "slurmd-n$i $!" >> "$dir/pids"
  done

  export SLURM_CONF=$dir/slurm.conf
  local idle=0
  for _ in $(seq 150); do
    idle=$(sinfo -h -N -o '%T' 2>/dev/null | grep -c '^idle' || true)
    [[ $idle == "$nodes" ]] && break
    while read -r name pid; do
      kill -0 "$pid" 2>/dev/null || { log "$name (pid $pid) died"; tail -5 "$dir"/log/*"${name#slurmd-}"* >&2 || true; false; }
    done < "$dir/pids"
    sleep 0.2
  done
  [[ $idle == "$nodes" ]] || { log "nodes not idle after 30 s: $(sinfo -h -N -o '%N=%T' 2>&1 | tr '\n' ' ')"; false; }
  trap - ERR
  if [[ -n $owner ]]; then
    # A watchdog that stops the cluster once the owner is gone (a killed test run must not leave daemons behind).
    ( while kill -0 "$owner" 2>/dev/null && [[ -f $dir/pids ]]; do sleep 1; done
      if [[ -f $dir/pids ]]; then bash "$0" stop --dir "$dir"; fi ) >>"$dir/log/watchdog.log" 2>&1 &
    echo $! > "$dir/watchdog.pid"
    log "watchdog pid $! stops the cluster when pid $owner exits"
  fi
  log "up: $nodes nodes (n1..n$nodes), $cpus CPUs and $gpus GPUs each, partition debug; state in $dir"
  echo "export SLURM_CONF=$dir/slurm.conf LOCAL_SLURM_DIR=$dir"
}

case $cmd in
  start) start_cluster ;;
  stop) stop_cluster ;;
  status) status_cluster ;;
  -h|--help|help) usage 0 ;;
  *) echo "local_slurm: unknown command $cmd (start | stop | status)" >&2; usage 1 ;;
esac
