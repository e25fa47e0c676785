#!/bin/bash
# Syscalls, context switches and CPU time per transaction of one process (a proxy) while
# pgbench drives 32 clients through it for 6 s; perf stat watches 4 s in the middle.
#
#   research/bench/syscalls.sh PORT PID LABEL [SCRIPT.sql]
#
# PORT: where pgbench connects (database app, user app, password $PGPASSWORD or
# app-bench-secret as in run.py's world); PID: the process to count; LABEL: names the
# output line. Transactions = pgbench's tps × 4 s. Used for research/proxy-cost.md; run the
# targets alternately, several rounds, on one cluster: single runs on this box vary ±20 %.
set -euo pipefail
port=$1 pid=$2 label=$3
script=${4:-$(dirname "$0")/read-1-of-200k.sql}
export PGPASSWORD=${PGPASSWORD:-app-bench-secret}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pgbench -n -h 127.0.0.1 -p "$port" -U app -c 32 -j 2 -T 6 -f "$script" app >"$tmp/pgbench" 2>&1 &
bench=$!
sleep 1
perf stat -x, -e raw_syscalls:sys_enter,context-switches,task-clock -p "$pid" -- sleep 4 2>"$tmp/stat"
wait "$bench"
tps=$(grep -oP 'tps = \K[0-9.]+' "$tmp/pgbench" | head -1)
awk -F, -v label="$label" -v tps="$tps" '
    NF > 3 { v[$3] = $1 }
    END {
        tx = tps * 4
        printf "%-10s tps %8.0f  syscalls/tx %5.2f  context-switches/tx %5.2f  cpu_us/tx %6.1f\n",
            label, tps, v["raw_syscalls:sys_enter"] / tx, v["context-switches"] / tx, v["task-clock"] * 1000 / tx
    }' "$tmp/stat"
