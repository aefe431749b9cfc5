#!/usr/bin/env bash
# A real SLURM on this one machine, for the `slurm` tests and for trying examples/train.sbatch:
# munge + slurmctld + one slurmd on 127.0.0.1, one CPU partition `cpu`, everything (config, spool,
# state, logs, PID files) in one state folder. Needs root (installs the Debian packages if missing).
#   scripts/slurm-local.sh start   # install if missing, write $STATE/slurm.conf, start, wait until idle
#   scripts/slurm-local.sh stop    # stop the daemons this script started, by their PID files
#   scripts/slurm-local.sh env     # the line to source: export SLURM_CONF=$STATE/slurm.conf
# STATE is $FLOPWISE_SLURM_STATE, default /tmp/flopwise-slurm; every SLURM command needs SLURM_CONF.
set -euo pipefail
STATE=${FLOPWISE_SLURM_STATE:-/tmp/flopwise-slurm}
CONF=$STATE/slurm.conf
export SLURM_CONF=$CONF

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

install() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && return
  echo "installing slurm-wlm and munge (apt-get)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
}

write_conf() {
  local host cpus mem
  host=$(hostname -s)
  cpus=$(nproc)
  mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)  # MB, leaving room for the daemons
  mkdir -p "$STATE/spool" "$STATE/state"
  cat >"$CONF" <<CONF
ClusterName=flopwise-local
SlurmctldHost=$host(127.0.0.1)
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmUser=root
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
# a job told to stop (scancel --signal=TERM, --signal=TERM@N) gets this long after the time limit
KillWait=60
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmdSpoolDir=$STATE/spool
StateSaveLocation=$STATE/state
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=cpu Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
}

start() {
  install
  write_conf
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    mkdir -p /run/munge && chown munge:munge /run/munge
    /usr/sbin/munged --force --pid-file="$STATE/munged.pid" 2>/dev/null  # --force: root, munge-owned folders
  fi
  running "$STATE/slurmctld.pid" || slurmctld -f "$CONF"
  running "$STATE/slurmd.pid" || slurmd -f "$CONF"
  for _ in $(seq 60); do
    if sinfo -h -o %T 2>/dev/null | grep -qx idle; then
      echo "SLURM up: partition cpu, node $(hostname -s) ($(nproc) CPUs); export SLURM_CONF=$CONF"
      return
    fi
    sleep 1
  done
  echo "SLURM did not come up in 60 s; see $STATE/slurmctld.log and $STATE/slurmd.log" >&2
  exit 1
}

stop() {
  for d in slurmd slurmctld munged; do
    if running "$STATE/$d.pid"; then kill "$(cat "$STATE/$d.pid")" && echo "stopped $d"; fi
    rm -f "$STATE/$d.pid"
  done
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
