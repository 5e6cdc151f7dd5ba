#!/usr/bin/env bash
# A real SLURM cluster of two nodes on this host for tests/slurm/ (make test-slurm): Debian's slurmctld, two
# slurmd and munge, configured for a container (no systemd, no cgroups: ../shared/SLURM.md's findings), with
# every file under $SLURM_TEST_DIR. Clients find it through SLURM_CONF=$SLURM_TEST_DIR/slurm.conf.
# Two nodes, two slurmd: Debian builds SLURM with --enable-multiple-slurmd (`scontrol show config` says
# MULTIPLE_SLURMD = Yes), so each NodeName has its own Port and its own `slurmd -N <name>`. The names are
# this host's short name and `localhost`, both resolving here: Lightning (slurm/train_gpu.sbatch) and
# slurm/train_trn1.sbatch take a job's first node name as MASTER_ADDR.
#   bash tests/slurm/cluster.sh start    # about 5 seconds; prints the SLURM_CONF to export
#   bash tests/slurm/cluster.sh stop
# It installs nothing: `make test-slurm` says which packages are missing (.ci/run installs them).
set -euo pipefail
DIR="${SLURM_TEST_DIR:-/tmp/moe-slurm}"
CONF="$DIR/slurm.conf"
HOST="$(hostname -s)"
NODES=("$HOST" localhost)  # node i: slurmd -N ${NODES[i]}, port 6818 + i

stop() {
  for pid in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid"; do
    [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true
  done
  pkill -f "slurmd -f $CONF" 2>/dev/null || true
  pkill -f "slurmctld -f $CONF" 2>/dev/null || true
  rm -f "$DIR"/*.pid
}

start() {
  for tool in munged slurmctld slurmd sbatch; do
    command -v "$tool" > /dev/null || { echo "$tool not found: install Debian's munge slurmctld slurmd \
slurm-client (apt-get install munge slurmctld slurmd slurm-client)" >&2; exit 2; }
  done
  [ "$HOST" != localhost ] || { echo "this host's short name is localhost: name it (hostname) for two nodes" >&2; \
    exit 2; }
  stop
  mkdir -p "$DIR/state" "$DIR/log"
  for node in "${NODES[@]}"; do mkdir -p "$DIR/spool/$node"; done
  # munge: its socket and log directories owned by its user; every SLURM message is signed with it
  if ! pgrep -x munged > /dev/null; then
    install -d -o munge -g munge -m 0755 /run/munge /var/log/munge /var/lib/munge
    [ -f /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; \
      chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key; }
    runuser -u munge -- /usr/sbin/munged
  fi
  local memory_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))
  cat > "$CONF" <<CONF
ClusterName=moe-test
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
# a requeued job waits cred_expire seconds before it starts again (SLURM's default 120)
AuthInfo=cred_expire=10
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldPort=6817
NodeName=${NODES[0]} NodeHostname=$HOST NodeAddr=127.0.0.1 Port=6818 CPUs=$(nproc) RealMemory=$memory_mb State=UNKNOWN
NodeName=${NODES[1]} NodeHostname=$HOST NodeAddr=127.0.0.1 Port=6819 CPUs=$(nproc) RealMemory=$memory_mb State=UNKNOWN
PartitionName=test Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
  export SLURM_CONF="$CONF"
  slurmctld -f "$CONF"
  for node in "${NODES[@]}"; do slurmd -f "$CONF" -N "$node"; done
  for _ in $(seq 60); do
    [ "$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" = "${#NODES[@]}" ] && \
      { echo "SLURM_CONF=$CONF"; return; }
    sleep 0.5
  done
  echo "the SLURM nodes did not come up; logs in $DIR/log" >&2
  sinfo -N >&2 || true
  tail -5 "$DIR"/log/*.log >&2
  exit 1
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
