#!/usr/bin/env bash
# A single-node Slurm on this machine (Debian's slurm-wlm and munge), for trying `scripts/study.py --executor slurm`
# and for the `slurm` tests: installs what is missing, writes /etc/slurm/slurm.conf for this host (partition
# `local`, SLURM_CPUS CPUs, default: all), starts munged, slurmctld and slurmd, and waits until the node is idle.
# Run as root; running it again restarts the daemons with a fresh configuration. Stop: scripts/slurm_local.sh stop
set -euo pipefail
stop() {  # the daemons this script started, by the pid files they write (and only if the pid is still theirs)
    for d in slurmd:/run/slurmd.pid slurmctld:/run/slurmctld.pid munged:/run/munge/munged.pid; do
        pid=$(cat "${d#*:}" 2>/dev/null) || continue
        if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "${d%%:*}" ]; then kill "$pid"; fi
    done
    sleep 1
}
if [ "${1:-}" = stop ]; then stop; exit 0; fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi
host=$(hostname -s)
cpus=${SLURM_CPUS:-$(nproc)}
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
cat > /etc/slurm/slurm.conf <<EOF
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
KillWait=10
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
stop
[ -s /etc/munge/munge.key ] || mungekey --create --keyfile /etc/munge/munge.key
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key
runuser -u munge -- /usr/sbin/munged
/usr/sbin/slurmctld -c -i
/usr/sbin/slurmd -c
for _ in $(seq 60); do
    if sinfo -h -n "$host" -o %t 2>/dev/null | grep -qx idle; then sinfo; exit 0; fi
    scontrol update nodename="$host" state=resume 2>/dev/null || true
    sleep 1
done
echo "error: the Slurm node $host did not come up; see /var/log/slurm/slurmd.log and slurmctld.log" >&2
exit 1
