#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for the tests and for developers.
#
#   tests/slurm/cluster.sh up      # munged, a private mariadbd, slurmdbd, slurmctld, slurmd n1..n4
#   tests/slurm/cluster.sh env     # prints `export SLURM_CONF=...` for your shell
#   tests/slurm/cluster.sh down    # stops everything it started
#
# Needs root and Debian's packages: slurm-wlm slurm-client munge slurmdbd mariadb-server
# (.ci/run installs them). Four emulated nodes n1..n4 (2 CPUs each) run as four slurmd
# processes (Debian builds Slurm with MULTIPLE_SLURMD); n1, n2 and n4 resolve to 127.0.0.1 through
# /etc/hosts, so a job's first node "n1" is a real hostname for the rendezvous. n3 deliberately does
# not: a site whose node names are in no DNS, where Slurm reaches a node at its NodeAddr alone.
# Settings are tuned for tests: scheduling every second, requeued jobs restart in seconds.
set -euo pipefail

STATE=${AURA_SLURM_STATE:-/tmp/aura-slurm}
NODES=${AURA_SLURM_NODES:-4}
CONF=$STATE/etc/slurm.conf
CLUSTER=aura-test
DB_PORT=${AURA_SLURM_DB_PORT:-13306}
DBD_PORT=${AURA_SLURM_DBD_PORT:-16819}
CTLD_PORT=${AURA_SLURM_CTLD_PORT:-16817}
NODE_PORT0=${AURA_SLURM_NODE_PORT0:-17000}

log() { echo "[slurm-cluster] $*" >&2; }

alive() { # pid file -> true if that process is running (not a zombie: PID 1 here reaps lazily)
  local pid
  [[ -f $1 ]] || return 1
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ -n $pid && -r /proc/$pid/stat ]] || return 1
  [[ $(awk '{print $3}' "/proc/$pid/stat") != Z ]]
}

wait_for() { # seconds, description, command...
  local t=$1 what=$2
  shift 2
  for ((i = 0; i < t * 10; i++)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  log "timed out after ${t}s waiting for $what"
  return 1
}

write_configs() {
  mkdir -p "$STATE"/{etc,log,spool,ctld,db,run}
  local host
  host=$(hostname -s)
  cat >"$CONF" <<EOF
ClusterName=$CLUSTER
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
AuthType=auth/munge
CryptoType=crypto/munge
# No cgroups in containers: track processes by parent pid, no task confinement.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Test speed: schedule every second; a requeued job may restart after ~15 s, not 3 min.
SchedulerParameters=sched_interval=1,bf_interval=5
AuthInfo=cred_expire=10
KillWait=5
MinJobAge=30
ReturnToService=2
MailProg=/bin/true
MpiDefault=none
JobRequeue=1
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
AccountingStoreFlags=job_comment
NodeName=n[1-$NODES] NodeHostname=$host NodeAddr=127.0.0.1 Port=[$((NODE_PORT0 + 1))-$((NODE_PORT0 + NODES))] CPUs=2 RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
PartitionName=long Nodes=n[1-$NODES] Default=NO MaxTime=INFINITE State=UP
EOF
  cat >"$STATE/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=$host
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$STATE/run/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=root
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$STATE/etc/slurmdbd.conf"
  cp /etc/slurm/plugstack.conf "$STATE/etc/" 2>/dev/null || true
}

start_munge() {
  if pgrep -x munged >/dev/null; then return 0; fi
  [[ -f /etc/munge/munge.key ]] || mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- /usr/sbin/munged
  wait_for 10 munged bash -c 'munge -n | unmunge'
}

start_mariadb() {
  if alive "$STATE/run/mariadbd.pid"; then return 0; fi
  if [[ ! -d $STATE/db/mysql ]]; then
    mariadb-install-db --user=root --datadir="$STATE/db" --auth-root-authentication-method=normal >"$STATE/log/mariadb-install.log" 2>&1
  fi
  nohup /usr/sbin/mariadbd --user=root --datadir="$STATE/db" --bind-address=127.0.0.1 --port="$DB_PORT" \
    --socket="$STATE/run/mariadb.sock" --pid-file="$STATE/run/mariadbd.pid" --skip-log-bin \
    --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 >"$STATE/log/mariadbd.log" 2>&1 &
  wait_for 30 mariadbd mariadb --socket="$STATE/run/mariadb.sock" -uroot -e 'select 1'
}

start_slurm() {
  export SLURM_CONF=$CONF
  if ! alive "$STATE/run/slurmdbd.pid"; then
    SLURM_CONF=$CONF /usr/sbin/slurmdbd
    wait_for 20 slurmdbd sacctmgr -n list cluster
  fi
  sacctmgr -i add cluster "$CLUSTER" >/dev/null 2>&1 || true
  if ! alive "$STATE/run/slurmctld.pid"; then
    /usr/sbin/slurmctld -f "$CONF"
    wait_for 20 slurmctld scontrol ping
  fi
  for ((n = 1; n <= NODES; n++)); do
    if ! alive "$STATE/run/slurmd-n$n.pid"; then
      mkdir -p "$STATE/spool/n$n"
      /usr/sbin/slurmd -f "$CONF" -N "n$n"
    fi
  done
  # Every node idle (not down/unknown/drained) before a test submits anything.
  wait_for 30 "all nodes idle" bash -c "[[ \$(sinfo -h -N -p debug -o '%t' | sort -u) == idle ]]"
}

hosts_entries() {
  local names="" line others
  for ((n = 1; n <= NODES; n++)); do [[ $n == 3 ]] || names+=" n$n"; done
  line="127.0.0.1$names # aura-slurm-nodes"
  grep -qxF "$line" /etc/hosts && return
  # Only our own line is replaced (an earlier one named n3 too); written in place, as Docker bind-mounts the file.
  others=$(grep -v "# aura-slurm-nodes$" /etc/hosts || true)
  printf '%s\n%s\n' "$others" "$line" >/etc/hosts
}

up() {
  local t0=$SECONDS
  # No controller state means job ids start again at 1: accounting left by a cluster that was
  # not taken down (a killed CI run) would describe other jobs under the same ids.
  if [[ ! -e $STATE/ctld/job_state ]] && ! alive "$STATE/run/mariadbd.pid"; then rm -rf "$STATE/db"; fi
  write_configs
  hosts_entries
  start_munge
  start_mariadb
  start_slurm
  log "cluster up in $((SECONDS - t0))s: nodes n1..n$NODES, SLURM_CONF=$CONF"
}

stop_pidfile() {
  local f=$1
  alive "$f" || return 0
  kill "$(cat "$f")" 2>/dev/null || true
  for _ in $(seq 100); do alive "$f" || return 0; sleep 0.1; done
  kill -9 "$(cat "$f")" 2>/dev/null || true
}

down() {
  export SLURM_CONF=$CONF
  scancel --user="$(id -un)" >/dev/null 2>&1 || true
  for f in "$STATE"/run/slurmd-*.pid; do [[ -e $f ]] && stop_pidfile "$f"; done
  stop_pidfile "$STATE/run/slurmctld.pid"
  stop_pidfile "$STATE/run/slurmdbd.pid"
  stop_pidfile "$STATE/run/mariadbd.pid"
  # Job ids restart at 1 on a fresh cluster, so the accounting database goes with the state:
  # a kept one would answer sacct for a new job 253 with an old job 253's times.
  rm -rf "$STATE/ctld" "$STATE/spool" "$STATE/db"
  log "cluster down"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *)
    echo "usage: $0 up|down|env" >&2
    exit 2
    ;;
esac
