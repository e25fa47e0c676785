#!/usr/bin/env bash
# LokaDB demo: build the proxy, start a throwaway "cloud" Postgres 18 cluster and the proxy in
# front of it, run a short workload straight to Postgres and through LokaDB side by side, and
# leave both running for you to connect to (Ctrl-C stops them and removes the data).
#
#   bash scripts/demo.sh              # on Debian 12, as root
#   bash scripts/demo.sh --no-wait    # stop everything at the end (CI smoke)
#   bash scripts/demo.sh --no-build   # use target/release/lokadb as it is
#
# Everything lives in <repo>/.demo (git-ignored): the cluster's data dir, lokadb.json,
# proxy.log, postgres.log. A second run first stops whatever a previous run left behind.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEMO="$REPO/.demo"
PG_BIN="$REPO/.pg/bin"
LOKADB="${CARGO_TARGET_DIR:-$REPO/target}/release/lokadb"
PG_USER="lokadb-pg"
APP_PASSWORD="app"
BENCH_SECONDS=5   # per round; two rounds per target, interleaved
BENCH_CLIENTS=4

WAIT=1
BUILD=1
for arg in "$@"; do
    case "$arg" in
        --no-wait) WAIT=0 ;;
        --no-build) BUILD=0 ;;
        -h | --help)
            sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "[demo] unknown argument: $arg (try --help)" >&2
            exit 2
            ;;
    esac
done

say() { printf '[demo] %s\n' "$*"; }
die() {
    printf '[demo] error: %s\n' "$*" >&2
    exit 1
}

[[ "$(id -u)" == 0 ]] || die "run as root (setup installs packages; the cluster runs as $PG_USER)"
if ! command -v cargo >/dev/null 2>&1 && [[ -x "$HOME/.cargo/bin/cargo" ]]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
# The demo's clients must not pick up a caller's libpq settings.
while IFS= read -r var; do unset "$var"; done < <(compgen -e | grep '^PG' || true)

# --- stop what a previous run left behind ---------------------------------------------------
stop_previous() {
    if [[ -f "$DEMO/proxy.pid" ]]; then
        local pid
        pid="$(cat "$DEMO/proxy.pid")"
        if [[ "$pid" =~ ^[0-9]+$ ]] && [[ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" == lokadb* ]]; then
            say "stopping the proxy of a previous run (pid $pid)"
            kill -TERM "$pid" 2>/dev/null || true
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    if [[ -f "$DEMO/pgdata/postmaster.pid" ]]; then
        say "stopping the cluster of a previous run"
        runuser -u "$PG_USER" -- "$PG_BIN/pg_ctl" -D "$DEMO/pgdata" -m immediate -w stop >/dev/null 2>&1 || true
    fi
    rm -rf "$DEMO"
}

# --- 1. setup and build ---------------------------------------------------------------------
say "step 1/5: setup (apt packages, PostgreSQL 18 venv, user $PG_USER)"
bash "$REPO/scripts/setup.sh" </dev/null
if ((BUILD)); then
    say "step 2/5: cargo build --release -p lokadb"
    command -v cargo >/dev/null 2>&1 || die "cargo not found: install Rust (https://rustup.rs) first"
    (cd "$REPO" && cargo build --release -p lokadb)
else
    say "step 2/5: build skipped (--no-build)"
fi
[[ -x "$LOKADB" ]] || die "$LOKADB does not exist (run without --no-build)"
for b in initdb pg_ctl psql pgbench; do
    [[ -x "$PG_BIN/$b" ]] || die "$PG_BIN/$b missing: scripts/setup.sh did not finish"
done

stop_previous

# --- 2. a throwaway cloud cluster -----------------------------------------------------------
PROXY_PID=""
FAILED=1
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ -n "$PROXY_PID" ]] && kill -0 "$PROXY_PID" 2>/dev/null; then
        kill -TERM "$PROXY_PID" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$PROXY_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$PROXY_PID" 2>/dev/null || true
    fi
    if [[ -f "$DEMO/pgdata/postmaster.pid" ]]; then
        runuser -u "$PG_USER" -- "$PG_BIN/pg_ctl" -D "$DEMO/pgdata" -m fast -w stop >/dev/null 2>&1 || true
    fi
    if ((FAILED)) && [[ -d "$DEMO" ]]; then
        for log in proxy.log postgres.log; do
            if [[ -s "$DEMO/$log" ]]; then
                printf '\n[demo] last lines of .demo/%s:\n' "$log" >&2
                tail -n 20 "$DEMO/$log" >&2
            fi
        done
        rm -rf "$DEMO/pgdata"
        say "stopped; logs kept in $DEMO" >&2
    elif [[ -d "$DEMO" ]]; then
        rm -rf "$DEMO"
        say "stopped; removed $DEMO"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
    /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

say "step 3/5: throwaway cloud cluster (PostgreSQL 18, run as $PG_USER, data in .demo/pgdata)"
mkdir -p "$DEMO"
chmod 755 "$DEMO"
mkdir -m 700 "$DEMO/pgdata" "$DEMO/run"
chown "$PG_USER:" "$DEMO/pgdata" "$DEMO/run"
SUPER_PASSWORD="$(head -c 18 /dev/urandom | base64 | tr -d '/+=')"
AUTH_PASSWORD="$(head -c 18 /dev/urandom | base64 | tr -d '/+=')"
PWFILE="$DEMO/run/superuser.pw"
printf '%s\n' "$SUPER_PASSWORD" >"$PWFILE"
chown "$PG_USER:" "$PWFILE"
chmod 600 "$PWFILE"
runuser -u "$PG_USER" -- "$PG_BIN/initdb" -D "$DEMO/pgdata" -U postgres --pwfile="$PWFILE" \
    --auth-local=trust --auth-host=scram-sha-256 -E UTF8 --no-instructions >"$DEMO/initdb.log" 2>&1 ||
    { cat "$DEMO/initdb.log" >&2; die "initdb failed"; }
rm -f "$PWFILE"
touch "$DEMO/postgres.log"
chown "$PG_USER:" "$DEMO/postgres.log"

PG_PORT=""
for _ in 1 2 3 4 5; do
    PG_PORT="$(free_port)"
    if runuser -u "$PG_USER" -- "$PG_BIN/pg_ctl" -D "$DEMO/pgdata" -l "$DEMO/postgres.log" -w -t 60 \
        -o "-c port=$PG_PORT -c listen_addresses=127.0.0.1 -c unix_socket_directories=$DEMO/run \
            -c password_encryption=scram-sha-256 -c fsync=off -c synchronous_commit=off \
            -c max_connections=100" start >/dev/null; then
        break
    fi
    PG_PORT=""
done
[[ -n "$PG_PORT" ]] || die "PostgreSQL did not start (see .demo/postgres.log)"
say "cloud PostgreSQL on 127.0.0.1:$PG_PORT"

su_psql() { "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -h "$DEMO/run" -p "$PG_PORT" -U postgres "$@"; }
su_psql -d postgres >/dev/null <<SQL
CREATE ROLE app LOGIN PASSWORD '$APP_PASSWORD';
CREATE DATABASE app OWNER app;
CREATE ROLE lokadb_auth LOGIN SUPERUSER PASSWORD '$AUTH_PASSWORD';
SQL
say "roles: app (password '$APP_PASSWORD', owns database app), lokadb_auth (superuser, reads verifiers)"

# --- 3. the proxy ---------------------------------------------------------------------------
say "step 4/5: LokaDB proxy"
cat >"$DEMO/lokadb.json" <<JSON
{
  "listen": "127.0.0.1:0",
  "databases": {
    "app": {
      "cloud": "host=127.0.0.1 port=$PG_PORT dbname=app",
      "auth_user": "lokadb_auth",
      "auth_password": "$AUTH_PASSWORD"
    }
  }
}
JSON
chmod 600 "$DEMO/lokadb.json"
: >"$DEMO/proxy.log"
# Its own session, so a Ctrl-C reaches this script (whose trap stops it) and not the proxy.
LOKADB_LOG=info setsid "$LOKADB" proxy --config "$DEMO/lokadb.json" >>"$DEMO/proxy.log" 2>&1 </dev/null &
PROXY_PID=$!
echo "$PROXY_PID" >"$DEMO/proxy.pid"
PROXY_ADDR=""
for _ in $(seq 200); do
    PROXY_ADDR="$(sed -n 's/^lokadb proxy listening on //p' "$DEMO/proxy.log" | head -n 1 || true)"
    [[ -n "$PROXY_ADDR" ]] && break
    kill -0 "$PROXY_PID" 2>/dev/null || die "the proxy exited before listening"
    sleep 0.1
done
[[ -n "$PROXY_ADDR" ]] || die "no 'lokadb proxy listening on' line within 20 s"
PROXY_PORT="${PROXY_ADDR##*:}"
say "proxy listening on $PROXY_ADDR (pid $PROXY_PID, log .demo/proxy.log)"

# --- 4. workload ----------------------------------------------------------------------------
DIRECT_DSN="host=127.0.0.1 port=$PG_PORT dbname=app user=app password=$APP_PASSWORD"
PROXY_DSN="host=127.0.0.1 port=$PROXY_PORT dbname=app user=app password=$APP_PASSWORD"

say "step 5/5: workload"
say "pgbench -i -s 5 through LokaDB (COPY of 500k rows)"
"$PG_BIN/pgbench" -i -s 5 -q "$PROXY_DSN" >"$DEMO/pgbench-init.log" 2>&1 ||
    { cat "$DEMO/pgbench-init.log" >&2; die "pgbench -i through the proxy failed"; }
tail -n 1 "$DEMO/pgbench-init.log" | sed 's/^/         /'

# pgbench prints "latency average = X ms" and "tps = Y (without initial connection time)".
declare -A TPS LAT
run_bench() { # target dsn round
    local out="$DEMO/pgbench-$1-$3.log"
    "$PG_BIN/pgbench" -n -S -c "$BENCH_CLIENTS" -j 2 -T "$BENCH_SECONDS" "$2" >"$out" 2>&1 ||
        { cat "$out" >&2; die "pgbench against $1 failed"; }
    local tps lat
    tps="$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' "$out" | head -n 1)"
    lat="$(sed -n 's/^latency average = \([0-9.]*\) ms.*/\1/p' "$out" | head -n 1)"
    [[ -n "$tps" && -n "$lat" ]] || { cat "$out" >&2; die "cannot read pgbench's output"; }
    TPS[$1]="${TPS[$1]:-} $tps"
    LAT[$1]="${LAT[$1]:-} $lat"
}
say "pgbench select-only: $BENCH_CLIENTS clients, 2 rounds of ${BENCH_SECONDS} s per target, interleaved"
for round in 1 2; do
    run_bench direct "$DIRECT_DSN" "$round"
    run_bench lokadb "$PROXY_DSN" "$round"
done
/usr/bin/python3 - "${TPS[direct]}" "${LAT[direct]}" "${TPS[lokadb]}" "${LAT[lokadb]}" <<'EOF'
import sys
mean = lambda s: sum(map(float, s.split())) / len(s.split())
dt, dl, lt, ll = (mean(a) for a in sys.argv[1:5])
print()
print(f"  {'':26}{'tps':>10}{'avg latency':>14}")
print(f"  {'straight to PostgreSQL':26}{dt:>10.0f}{dl:>11.3f} ms")
print(f"  {'through LokaDB':26}{lt:>10.0f}{ll:>11.3f} ms")
print(f"  {'LokaDB / direct':26}{lt / dt:>10.2f}{ll / dl:>11.2f} x")
print()
print("  (2-core machines are noisy and the proxy shares the CPUs with Postgres and pgbench;")
print("   research/bench/run.py measures properly.)")
print()
EOF

say "pool reuse: SELECT current_user, pg_backend_pid() in 4 separate psql sessions each way"
pids_of() { # dsn
    for _ in 1 2 3 4; do
        "$PG_BIN/psql" -X -q -At -F ' ' -c 'SELECT current_user, pg_backend_pid()' "$1"
    done
}
echo "  straight to PostgreSQL (a new backend per session):"
pids_of "$DIRECT_DSN" | sed 's/^/    /'
echo "  through LokaDB (warm backends from the pool of the core that accepted the session):"
pids_of "$PROXY_DSN" | tee "$DEMO/pids-proxy.txt" | sed 's/^/    /'
distinct="$(cut -d' ' -f2 "$DEMO/pids-proxy.txt" | sort -u | wc -l)"
echo "  -> 4 sessions through LokaDB used $distinct backend(s); each core keeps its own pool"
echo

FAILED=0
echo "LokaDB is running:"
echo "  proxy : $PROXY_ADDR   (log: $DEMO/proxy.log)"
echo "  cloud : 127.0.0.1:$PG_PORT (PostgreSQL 18, data: $DEMO/pgdata)"
echo "  connect through the proxy:"
echo "    $PG_BIN/psql \"$PROXY_DSN\""
echo "    postgresql://app:$APP_PASSWORD@127.0.0.1:$PROXY_PORT/app"
if ((WAIT)); then
    echo
    echo "press Ctrl-C to stop (stops the proxy and the cluster, removes .demo)"
    while kill -0 "$PROXY_PID" 2>/dev/null; do sleep 1; done
    FAILED=1
    die "the proxy exited (see .demo/proxy.log)"
fi
say "--no-wait: stopping"
