#!/bin/bash
# A Slurm cluster on this one host, for the tests that submit slurm/train.sbatch for real.
#
#   tests/slurm/cluster.sh start DIR [NODES]   # install what is missing, start, wait until idle
#   tests/slurm/cluster.sh stop DIR            # cancel the jobs, stop every daemon it started
#   tests/slurm/cluster.sh install             # only install what is missing (apt-get, root)
#   . DIR/env                                  # SLURM_CONF=DIR/slurm.conf: sbatch, squeue, ...
#
# Everything lives under DIR (config, munge key and socket, state, spool, logs, pid files):
# nothing in /etc is read or written, so it runs beside a cluster this host may belong to.
# Needs root (slurmd runs jobs as their users; apt-get installs missing packages). No systemd
# and no cgroups: process tracking by parent pid (proctrack/linuxproc), no task binding.
#
# Each node claims 16 CPUs whatever the host has (SlurmdParameters=config_overrides) and jobs
# share it (OverSubscribe), so the tests' jobs run at once and their waits on the clock
# overlap. NODES=2 starts two slurmd daemons (node1, node2) on distinct ports, for a job of
# `sbatch -N 2` on one host: that needs a Slurm built with --enable-multiple-slurmd.
#
# Timing: slurmctld checks time limits and --signal warnings every 30 s (a constant in
# Slurm), so a job with --time=1 gets its signal 0-30 s after it is due, and after the limit
# its processes get SIGTERM, then SIGKILL KillWait (here 45 s) later: time for a save on a
# loaded machine (at 20 s, with the load at 9, a job at its limit was killed before its batch
# script could say whether it requeues).
set -euo pipefail

usage() { echo "usage: $0 start DIR [NODES] | stop DIR | install" >&2; exit 2; }
[[ $# -ge 2 || ${1:-} == install ]] || usage
action=$1
dir=$(realpath -m "${2:-.}")
nodes=${3:-1}

install_missing() {
    local missing=()
    command -v munged >/dev/null || missing+=(munge)
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    [[ ${#missing[@]} == 0 ]] && return 0
    if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
        echo "cluster.sh: ${missing[*]} missing, and no apt-get as root to install them" >&2
        exit 3
    fi
    echo "cluster.sh: installing ${missing[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    local log t0=$SECONDS
    log=$(mktemp)
    # A clean machine may have no package lists yet.
    if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >"$log" 2>&1; then
        apt-get update -q >>"$log" 2>&1
        apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$log" 2>&1 \
            || { tail -20 "$log" >&2; rm -f "$log"; exit 3; }
    fi
    rm -f "$log"
    echo "cluster.sh: installed in $((SECONDS - t0)) s"
}

free_ports() {  # $1 ports nobody listens on now
    python3 - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

# Start a daemon in the foreground of its own session, output to its log; record its pid.
daemon() {  # name command...
    local name=$1
    shift
    setsid "$@" </dev/null >>"$dir/log/$name.out" 2>&1 &
    echo $! >"$dir/pid/$name"
}

start() {
    if [[ -e $dir/pid ]]; then
        echo "cluster.sh: $dir already has a cluster (stop it first)" >&2
        exit 2
    fi
    mkdir -p "$dir"
    install_missing
    mkdir -p "$dir"/{pid,log,state,spool,munge}
    chmod 755 "$dir"
    # munged refuses a key or socket directory others can write to, and runs as munge.
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 711 "$dir/munge"  # the socket: reachable by all, listed by none
    chmod 400 "$dir/munge/munge.key"
    chown -R munge: "$dir/munge"
    local socket="$dir/munge/munge.socket"
    daemon munged setpriv --reuid=munge --regid=munge --clear-groups munged --foreground --socket="$socket" \
        --key-file="$dir/munge/munge.key" --pid-file="$dir/munge/munged.pid" \
        --seed-file="$dir/munge/seed" --log-file="$dir/munge/munged.log"

    local host ports ctld_port cpus=16 mem=4000
    host=$(hostname -s)
    read -r -a ports <<<"$(free_ports $((nodes + 1)))"
    ctld_port=${ports[0]}
    {
        echo "ClusterName=tests"
        echo "SlurmctldHost=$host(127.0.0.1)"
        echo "SlurmctldPort=$ctld_port"
        echo "SlurmUser=root"
        echo "AuthType=auth/munge"
        # cred_expire: also how long a requeued job waits before it may start again (120 s).
        echo "AuthInfo=socket=$socket,cred_expire=5"
        echo "StateSaveLocation=$dir/state"
        echo "SlurmdSpoolDir=$dir/spool/%n"
        echo "SlurmctldPidFile=$dir/state/slurmctld.pid"
        echo "SlurmdPidFile=$dir/spool/slurmd-%n.pid"
        echo "SlurmctldLogFile=$dir/log/slurmctld.log"
        echo "SlurmdLogFile=$dir/log/slurmd-%n.log"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_CPU"
        echo "SlurmdParameters=config_overrides"
        echo "JobRequeue=1"
        echo "MpiDefault=none"
        echo "ReturnToService=2"
        echo "KillWait=45"
        echo "MinJobAge=300"
        echo "SchedulerParameters=sched_interval=1"
        if [[ $nodes == 1 ]]; then
            echo "NodeName=$host NodeAddr=127.0.0.1 Port=${ports[1]} CPUs=$cpus RealMemory=$mem"
        else
            for ((i = 1; i <= nodes; i++)); do
                echo "NodeName=node$i NodeHostname=$host NodeAddr=127.0.0.1 Port=${ports[i]}" \
                    "CPUs=$cpus RealMemory=$mem"
            done
        fi
        echo "PartitionName=tests Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES:8"
    } >"$dir/slurm.conf"
    echo "export SLURM_CONF=$dir/slurm.conf" >"$dir/env"
    export SLURM_CONF=$dir/slurm.conf

    local t0=$SECONDS
    until [[ -S $socket ]]; do
        if ((SECONDS - t0 > 20)) || ! kill -0 "$(cat "$dir/pid/munged")" 2>/dev/null; then
            echo "cluster.sh: munged did not start:" >&2
            cat "$dir/log/munged.out" "$dir/munge/munged.log" >&2 || true
            exit 1
        fi
        sleep 0.1
    done
    daemon slurmctld slurmctld -D -i
    if [[ $nodes == 1 ]]; then
        daemon slurmd slurmd -D
    else
        for ((i = 1; i <= nodes; i++)); do daemon "slurmd-node$i" slurmd -D -N "node$i"; done
    fi
    until [[ $(sinfo -h -o %T 2>/dev/null | sort -u) == idle ]]; do
        if ((SECONDS - t0 > 40)); then
            echo "cluster.sh: the node(s) did not become idle in 40 s:" >&2
            sinfo -N >&2 || true
            tail -n 20 "$dir"/log/*.log >&2 || true
            exit 1
        fi
        sleep 0.2
    done
    echo "cluster.sh: Slurm $(sinfo -V | cut -d' ' -f2) up in $((SECONDS - t0)) s," \
        "$nodes node(s) idle; . $dir/env"
}

stop() {
    [[ -d $dir/pid ]] || return 0
    export SLURM_CONF=$dir/slurm.conf
    # Jobs first, while slurmd can still end their processes.
    local ids t0=$SECONDS
    ids=$(squeue -h -o %A 2>/dev/null | sort -u | paste -sd' ' || true)
    if [[ -n $ids ]]; then
        # shellcheck disable=SC2086  # one word per job id
        scancel $ids 2>/dev/null || true
        while [[ -n $(squeue -h 2>/dev/null) ]] && ((SECONDS - t0 < 30)); do sleep 0.5; done
    fi
    local f pid
    for f in "$dir"/pid/slurmd* "$dir/pid/slurmctld" "$dir/pid/munged"; do
        [[ -e $f ]] || continue
        pid=$(cat "$f")
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
        rm -f "$f"
    done
    rmdir "$dir/pid"
}

case $action in
    install) install_missing ;;
    start) start ;;
    stop) stop ;;
    *) usage ;;
esac
