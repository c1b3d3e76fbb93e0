#!/usr/bin/env bash
# A two-node SLURM cluster on this one machine, for the SLURM tests (tests/slurm/) and for trying the
# launcher's scripts by hand. Both nodes (n1, n2; one CPU each) are this host, reached on 127.0.0.1
# through their own slurmd ports. Needs root and Debian/Ubuntu (apt).
#
#   bash scripts/slurm_local_cluster.sh up      # install (once), configure, start; quick when already up
#   bash scripts/slurm_local_cluster.sh status  # exit 0 when both nodes answer, else 1
#   bash scripts/slurm_local_cluster.sh down    # stop the daemons (the packages and config stay)
set -euo pipefail

CONF_DIR=/etc/slurm
CONF="${CONF_DIR}/slurm.conf"
STATE_DIR=/var/spool/slurmctld
LOG_DIR=/var/log/slurm
NODES=(n1 n2)
HOST="$(hostname)"

say() { echo "[slurm-local-cluster] $*" >&2; }

need_root() {
  if [[ "$(id -u)" -ne 0 ]]; then
    say "must run as root (it installs packages and starts system daemons)"
    exit 2
  fi
}

slurm_conf() {
  cat <<CONF
# Written by scripts/slurm_local_cluster.sh: two nodes on one host, for tests.
ClusterName=local
SlurmctldHost=${HOST}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=6817
SlurmctldPidFile=/var/run/slurmctld.pid
SlurmdPidFile=/var/run/slurmd-%n.pid
SlurmdSpoolDir=/var/spool/slurmd-%n
StateSaveLocation=${STATE_DIR}
SlurmctldLogFile=${LOG_DIR}/slurmctld.log
SlurmdLogFile=${LOG_DIR}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
JobRequeue=1
ReturnToService=2
KillWait=30
# the SLURM tests read a finished job's record (scontrol) up to an hour after it ended
MinJobAge=3600
SlurmdTimeout=60
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
NodeName=n1 NodeHostname=${HOST} NodeAddr=127.0.0.1 Port=17001 CPUs=1 RealMemory=10000 State=UNKNOWN
NodeName=n2 NodeHostname=${HOST} NodeAddr=127.0.0.1 Port=17002 CPUs=1 RealMemory=10000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
}

nodes_up() {
  # Both nodes known to the controller and in a usable state (idle, allocated, mixed, completing).
  local states
  states="$(sinfo --noheader --Node --format='%N %t' 2>/dev/null)" || return 1
  for node in "${NODES[@]}"; do
    grep -Eq "^${node} (idle|alloc|mix|comp)" <<<"${states}" || return 1
  done
}

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    return
  fi
  say "installing slurm-wlm and munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
}

start_munge() {
  install -d -m 0700 -o munge -g munge /etc/munge /var/lib/munge
  install -d -m 0755 -o munge -g munge /var/log/munge /run/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    say "creating a munge key"
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  if ! munge -n </dev/null >/dev/null 2>&1; then
    say "starting munged"
    runuser -u munge -- /usr/sbin/munged
  fi
}

write_config() {
  install -d "${CONF_DIR}" "${STATE_DIR}" "${LOG_DIR}"
  local wanted
  wanted="$(slurm_conf)"
  if [[ -f "${CONF}" ]] && ! head -n 1 "${CONF}" | grep -qF "$(slurm_conf | head -n 1)"; then
    say "${CONF} exists and was not written by this script (a real cluster's?); move it away first"
    exit 1
  fi
  if [[ ! -f "${CONF}" ]] || [[ "$(cat "${CONF}")" != "${wanted}" ]]; then
    say "writing ${CONF}"
    printf '%s\n' "${wanted}" >"${CONF}"
    if pid_alive /var/run/slurmctld.pid; then  # already up with the old settings
      say "reconfiguring the running daemons"
      scontrol reconfigure
    fi
  fi
  if ! grep -Eq '^127\.0\.0\.1([[:space:]].*)?[[:space:]]n1([[:space:]]|$)' /etc/hosts; then
    say "adding '127.0.0.1 n1 n2' to /etc/hosts"
    echo "127.0.0.1 n1 n2" >>/etc/hosts
  fi
}

pid_alive() { [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_daemons() {
  if ! pid_alive /var/run/slurmctld.pid; then
    say "starting slurmctld"
    slurmctld
  fi
  for node in "${NODES[@]}"; do
    install -d "/var/spool/slurmd-${node}"
    if ! pid_alive "/var/run/slurmd-${node}.pid"; then
      say "starting slurmd -N ${node}"
      slurmd -N "${node}"
    fi
  done
}

wait_for_nodes() {
  for _ in $(seq 1 60); do
    if nodes_up; then
      return
    fi
    # a node left DOWN by an earlier run comes back once its slurmd answers
    scontrol update nodename=n1,n2 state=resume >/dev/null 2>&1 || true
    sleep 1
  done
  say "the nodes did not come up; sinfo says:"
  sinfo --Node >&2 || true
  say "logs: ${LOG_DIR}/"
  exit 1
}

stop_daemons() {
  for pidfile in /var/run/slurmd-n1.pid /var/run/slurmd-n2.pid /var/run/slurmctld.pid; do
    if pid_alive "${pidfile}"; then
      kill "$(cat "${pidfile}")"
    fi
  done
}

case "${1:-}" in
  up)
    need_root
    if command -v sinfo >/dev/null && nodes_up; then
      write_config  # settings changed since it came up: rewritten, and the daemons reconfigured
      say "up: $(sinfo --noheader --Node --format='%N:%t' | tr '\n' ' ')"
      exit 0
    fi
    install_packages
    start_munge
    write_config
    start_daemons
    wait_for_nodes
    say "up: $(sinfo --noheader --Node --format='%N:%t' | tr '\n' ' ')"
    ;;
  status)
    if command -v sinfo >/dev/null && nodes_up; then
      sinfo --Node
      exit 0
    fi
    say "not up"
    exit 1
    ;;
  down)
    need_root
    stop_daemons
    say "stopped"
    ;;
  *)
    echo "usage: $0 up|status|down" >&2
    exit 2
    ;;
esac
