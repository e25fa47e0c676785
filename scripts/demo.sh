#!/usr/bin/env bash
# LokaDB demo: build the proxy and the agent, start a throwaway "cloud" Postgres 18 cluster and
# an organization's own cluster, the proxy (with the relay inside) and an agent beside the
# organization's database; run a short workload straight to Postgres and through LokaDB side by
# side, then register the organization (lokadb init, lokadb org add), read and write its rows from
# the cloud through postgres_fdw → relay → TLS tunnel → agent, turn a cloud table into a LokaDB
# table (lokadb enable) and pause one organization's writes, and leave everything running for
# you to connect to (Ctrl-C stops it all and removes the data).
#
#   bash scripts/demo.sh              # on Debian 12, as root
#   bash scripts/demo.sh --no-wait    # stop everything at the end (CI smoke)
#   bash scripts/demo.sh --no-build   # use target/release/lokadb as it is
#
# Everything lives in <repo>/.demo (git-ignored): the clusters' data dirs, lokadb.json,
# certificates, proxy.log, agent.log, postgres*.log. A second run first stops whatever a
# previous run left behind.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEMO="$REPO/.demo"
PG_BIN="$REPO/.pg/bin"
LOKADB="${CARGO_TARGET_DIR:-$REPO/target}/release/lokadb"
AGENT="${CARGO_TARGET_DIR:-$REPO/target}/release/lokadb-agent"
TEST_CERTS="${CARGO_TARGET_DIR:-$REPO/target}/release/test-certs"
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
            sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
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
    if [[ -f "$DEMO/agent.pid" ]]; then
        local pid
        pid="$(cat "$DEMO/agent.pid")"
        if [[ "$pid" =~ ^[0-9]+$ ]] && [[ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" == lokadb* ]]; then
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    for data in "$DEMO/pgdata" "$DEMO/orgdata"; do
        if [[ -f "$data/postmaster.pid" ]]; then
            say "stopping a cluster of a previous run"
            runuser -u "$PG_USER" -- "$PG_BIN/pg_ctl" -D "$data" -m immediate -w stop >/dev/null 2>&1 || true
        fi
    done
    rm -rf "$DEMO"
}

# --- 1. setup and build ---------------------------------------------------------------------
say "step 1/6: setup (apt packages, PostgreSQL 18 venv, user $PG_USER)"
bash "$REPO/scripts/setup.sh" </dev/null
if ((BUILD)); then
    say "step 2/6: cargo build --release -p lokadb -p lokadb-agent -p lokadb-tests --bins"
    command -v cargo >/dev/null 2>&1 || die "cargo not found: install Rust (https://rustup.rs) first"
    (cd "$REPO" && cargo build --release -p lokadb -p lokadb-agent -p lokadb-tests --bins)
else
    say "step 2/6: build skipped (--no-build)"
fi
for b in "$LOKADB" "$AGENT" "$TEST_CERTS"; do
    [[ -x "$b" ]] || die "$b does not exist (run without --no-build)"
done
for b in initdb pg_ctl psql pgbench; do
    [[ -x "$PG_BIN/$b" ]] || die "$PG_BIN/$b missing: scripts/setup.sh did not finish"
done

stop_previous

# --- 2. a throwaway cloud cluster -----------------------------------------------------------
PROXY_PID=""
AGENT_PID=""
WATCH_PID=""
FAILED=1
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ -n "$WATCH_PID" ]]; then
        kill -TERM "$WATCH_PID" 2>/dev/null || true
    fi
    if [[ -n "$AGENT_PID" ]]; then
        kill -TERM "$AGENT_PID" 2>/dev/null || true
    fi
    if [[ -n "$PROXY_PID" ]] && kill -0 "$PROXY_PID" 2>/dev/null; then
        kill -TERM "$PROXY_PID" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$PROXY_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$PROXY_PID" 2>/dev/null || true
    fi
    for data in "$DEMO/pgdata" "$DEMO/orgdata"; do
        if [[ -f "$data/postmaster.pid" ]]; then
            runuser -u "$PG_USER" -- "$PG_BIN/pg_ctl" -D "$data" -m fast -w stop >/dev/null 2>&1 || true
        fi
    done
    if ((FAILED)) && [[ -d "$DEMO" ]]; then
        for log in proxy.log agent.log postgres.log postgres-org.log; do
            if [[ -s "$DEMO/$log" ]]; then
                printf '\n[demo] last lines of .demo/%s:\n' "$log" >&2
                tail -n 20 "$DEMO/$log" >&2
            fi
        done
        rm -rf "$DEMO/pgdata" "$DEMO/orgdata"
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

# start_cluster NAME DATA LOG: initdb + start as $PG_USER on a free port; sets CLUSTER_PORT.
start_cluster() {
    local name="$1" data="$2" log="$3" pwfile="$DEMO/run/$1.pw"
    mkdir -m 700 "$data"
    chown "$PG_USER:" "$data"
    printf '%s\n' "$SUPER_PASSWORD" >"$pwfile"
    chown "$PG_USER:" "$pwfile"
    chmod 600 "$pwfile"
    runuser -u "$PG_USER" -- "$PG_BIN/initdb" -D "$data" -U postgres --pwfile="$pwfile" \
        --auth-local=trust --auth-host=scram-sha-256 -E UTF8 --no-instructions >"$DEMO/initdb-$name.log" 2>&1 ||
        { cat "$DEMO/initdb-$name.log" >&2; die "initdb of $name failed"; }
    rm -f "$pwfile"
    touch "$log"
    chown "$PG_USER:" "$log"
    CLUSTER_PORT=""
    for _ in 1 2 3 4 5; do
        CLUSTER_PORT="$(free_port)"
        if runuser -u "$PG_USER" -- "$PG_BIN/pg_ctl" -D "$data" -l "$log" -w -t 60 \
            -o "-c port=$CLUSTER_PORT -c listen_addresses=127.0.0.1 -c unix_socket_directories=$DEMO/run \
                -c password_encryption=scram-sha-256 -c fsync=off -c synchronous_commit=off \
                -c max_connections=100 -c max_prepared_transactions=10 -c wal_level=logical -c wal_writer_delay=10ms" start >/dev/null; then
            return 0
        fi
        CLUSTER_PORT=""
    done
    die "PostgreSQL ($name) did not start (see $log)"
}

say "step 3/6: throwaway clusters (PostgreSQL 18, run as $PG_USER): the cloud, and organization acme's own"
mkdir -p "$DEMO"
chmod 755 "$DEMO"
mkdir -m 700 "$DEMO/run"
chown "$PG_USER:" "$DEMO/run"
SUPER_PASSWORD="$(head -c 18 /dev/urandom | base64 | tr -d '/+=')"
AUTH_PASSWORD="$(head -c 18 /dev/urandom | base64 | tr -d '/+=')"
OPS_PASSWORD="$(head -c 18 /dev/urandom | base64 | tr -d '/+=')"
start_cluster cloud "$DEMO/pgdata" "$DEMO/postgres.log"
PG_PORT="$CLUSTER_PORT"
say "cloud PostgreSQL on 127.0.0.1:$PG_PORT (data .demo/pgdata)"
start_cluster org "$DEMO/orgdata" "$DEMO/postgres-org.log"
ORG_PORT="$CLUSTER_PORT"
say "organization acme's PostgreSQL on 127.0.0.1:$ORG_PORT (data .demo/orgdata) — in real life behind acme's firewall"

su_psql() { "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -h "$DEMO/run" -p "$PG_PORT" -U postgres "$@"; }
su_psql -d postgres >/dev/null <<SQL
CREATE ROLE app LOGIN PASSWORD '$APP_PASSWORD';
CREATE DATABASE app OWNER app;
CREATE ROLE lokadb_auth LOGIN SUPERUSER PASSWORD '$AUTH_PASSWORD';
CREATE ROLE ops LOGIN PASSWORD '$OPS_PASSWORD';
SQL
say "roles: app (password '$APP_PASSWORD', owns database app), lokadb_auth (superuser, reads verifiers), ops (the proxy's console)"
org_psql() { "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -h "$DEMO/run" -p "$ORG_PORT" -U postgres "$@"; }
org_psql -d postgres >/dev/null <<SQL
CREATE ROLE app LOGIN PASSWORD '$APP_PASSWORD';
CREATE DATABASE acme OWNER app;
SQL
org_psql -d acme >/dev/null <<SQL
CREATE TABLE documents (id int PRIMARY KEY, organization_id text NOT NULL, title text);
INSERT INTO documents SELECT g, 'acme', 'acme document ' || g FROM generate_series(1, 1000) g;
ALTER TABLE documents OWNER TO app;
SQL
say "acme's database: table documents with 1000 rows"

# --- 3. the proxy ---------------------------------------------------------------------------
say "step 4/6: LokaDB proxy, with the relay inside"
mkdir -m 700 "$DEMO/certs"
"$TEST_CERTS" "$DEMO/certs" >/dev/null
say "a throwaway CA and relay certificate in .demo/certs (bring your own PKI in production)"
"$LOKADB" token new acme >"$DEMO/token.txt"
ACME_TOKEN="$(sed -n 's/^token: //p' "$DEMO/token.txt")"
ACME_HASH="$(sed -n 's/^relay.tokens entry: "acme": "\(.*\)"$/\1/p' "$DEMO/token.txt")"
chmod 600 "$DEMO/token.txt"
say "lokadb token new acme: the agent gets the token, the relay keeps only its hash ($ACME_HASH)"
RELAY_AGENTS_PORT="$(free_port)"
RELAY_PG_PORT="$(free_port)"
METRICS_PORT="$(free_port)"
cat >"$DEMO/lokadb.json" <<JSON
{
  "listen": "127.0.0.1:0",
  "route_log": true,
  "admin_users": ["ops"],
  "metrics": "127.0.0.1:$METRICS_PORT",
  "handover": "$DEMO/handover.sock",
  "databases": {
    "app": {
      "cloud": "host=127.0.0.1 port=$PG_PORT dbname=app",
      "auth_user": "lokadb_auth",
      "auth_password": "$AUTH_PASSWORD",
      "direct": { "user": "app", "password": "$APP_PASSWORD" },
      "direct_pool": true
    },
    "app_tx": {
      "cloud": "host=127.0.0.1 port=$PG_PORT dbname=app",
      "auth_user": "lokadb_auth",
      "auth_password": "$AUTH_PASSWORD",
      "pool_mode": "transaction",
      "pool_size": 2
    }
  },
  "relay": {
    "agents": "127.0.0.1:$RELAY_AGENTS_PORT",
    "postgres": "127.0.0.1:$RELAY_PG_PORT",
    "tls": { "cert": "$DEMO/certs/relay.crt", "key": "$DEMO/certs/relay.key" },
    "tokens": { "acme": "$ACME_HASH" }
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
say "relay: agents dial 127.0.0.1:$RELAY_AGENTS_PORT (TLS); postgres_fdw and the direct path use 127.0.0.1:$RELAY_PG_PORT"

# --- 4. workload ----------------------------------------------------------------------------
DIRECT_DSN="host=127.0.0.1 port=$PG_PORT dbname=app user=app password=$APP_PASSWORD"
PROXY_DSN="host=127.0.0.1 port=$PROXY_PORT dbname=app user=app password=$APP_PASSWORD"

say "step 5/6: workload"
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

say "transaction pooling (database app_tx: pool_mode transaction, pool_size 2): 12 clients at once"
TX_DSN="host=127.0.0.1 port=$PROXY_PORT dbname=app_tx user=app password=$APP_PASSWORD"
tx_pids=()
for i in $(seq 12); do
    "$PG_BIN/psql" -X -q -At -c 'SELECT pg_sleep(0.2)' -c 'SELECT pg_backend_pid()' "$TX_DSN" \
        >"$DEMO/tx-$i.txt" 2>&1 &
    tx_pids+=("$!")
done
wait "${tx_pids[@]}"
tx_distinct="$(cat "$DEMO"/tx-*.txt | grep -E '^[0-9]+$' | sort -u | wc -l)"
tx_served="$(cat "$DEMO"/tx-*.txt | grep -cE '^[0-9]+$' || true)"
# A core whose backend would idle while the other core's clients wait closes it for them: the
# backends change over the run, never more than 2 at once.
echo "  -> $tx_served of 12 sessions answered by $tx_distinct cloud backend(s) over the run, at most 2 at once"
[ "$tx_served" = 12 ] || die "transaction pooling: $(cat "$DEMO"/tx-*.txt)"
echo "  a setting follows its session from one transaction's backend to the next:"
"$PG_BIN/psql" -X -q -At -c "SET work_mem = '3MB'" -c 'SHOW work_mem' "$TX_DSN" | sed 's/^/    work_mem: /'
echo

say "step 6/6: the tunnel — an agent beside acme's database dials out to the relay"
# Starts acme's agent and waits for its tunnel (the log is truncated first).
start_agent() {
    : >"$DEMO/agent.log"
    LOKADB_LOG=info LOKADB_TOKEN="$ACME_TOKEN" setsid "$AGENT" --relay "127.0.0.1:$RELAY_AGENTS_PORT" \
        --postgres "127.0.0.1:$ORG_PORT" --ca "$DEMO/certs/ca.crt" --max-conns 50 \
        >>"$DEMO/agent.log" 2>&1 </dev/null &
    AGENT_PID=$!
    echo "$AGENT_PID" >"$DEMO/agent.pid"
    for _ in $(seq 100); do
        grep -q '^lokadb-agent connected to' "$DEMO/agent.log" && break
        kill -0 "$AGENT_PID" 2>/dev/null || die "the agent exited (see .demo/agent.log)"
        sleep 0.1
    done
    grep -q '^lokadb-agent connected to' "$DEMO/agent.log" || die "the agent did not connect within 10 s"
}
start_agent
say "agent connected (pid $AGENT_PID, log .demo/agent.log; $(du -h "$AGENT" | cut -f1) binary, $(awk '/VmRSS/ {print $2 " kB"}' "/proc/$AGENT_PID/status") resident)"
CLOUD_DSN="host=$DEMO/run port=$PG_PORT dbname=app user=postgres"
say "lokadb init: the lokadb schema in the cloud (versioned migrations; idempotent)"
"$LOKADB" init --cloud "$CLOUD_DSN" | sed 's/^/    /'
say "lokadb org add acme: a postgres_fdw server through the relay, checked from the cloud itself"
say "  (plain TCP to the relay, said out loud: this PostgreSQL 18 build has no TLS in its libpq; with one, the default is --relay-sslmode verify-full with the relay's CA)"
"$LOKADB" org add acme --cloud "$CLOUD_DSN" --via-relay "127.0.0.1:$RELAY_PG_PORT" --dbname acme \
    --user app --password "$APP_PASSWORD" --name "Acme Corp" --relay-sslmode disable | sed 's/^/    /'
"$LOKADB" org list --cloud "$CLOUD_DSN" | sed 's/^/    /'
su_psql -d app >/dev/null <<SQL
CREATE FOREIGN TABLE acme_documents (id int, organization_id text, title text)
  SERVER lokadb_org_acme OPTIONS (table_name 'documents');
ALTER FOREIGN TABLE acme_documents OWNER TO app;
SQL
app_sql() { "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=1 "$PROXY_DSN" -c "$1"; }
echo "  through the proxy, the cloud reads acme's rows in acme's own database:"
echo "    SELECT count(*) FROM acme_documents  -> $(app_sql 'SELECT count(*) FROM acme_documents')"
app_sql "INSERT INTO acme_documents VALUES (1001, 'acme', 'written from the cloud')"
app_sql "UPDATE acme_documents SET title = 'updated from the cloud' WHERE id = 1"
echo "  an INSERT and an UPDATE from the cloud landed in acme's database:"
org_psql -d acme -At -c "SELECT id, title FROM documents WHERE id IN (1, 1001) ORDER BY id" | sed 's/^/    /'
echo "  the relay's counters (psql dbname=lokadb_relay, SHOW TUNNELS):"
"$PG_BIN/psql" -X -q -P pager=off -h 127.0.0.1 -p "$RELAY_PG_PORT" -U ops -d lokadb_relay \
    -c "SHOW TUNNELS" | sed 's/^/    /'
echo "  an organization the relay does not know is refused at once, with a reason:"
"$PG_BIN/psql" -X -q "host=127.0.0.1 port=$RELAY_PG_PORT dbname=initech/app user=app" -c 'SELECT 1' 2>&1 |
    sed 's/^/    /' || true

say "lokadb enable notes: a cloud table becomes a LokaDB table (LIST partitions, DEFAULT holds everyone)"
su_psql -d app >/dev/null <<SQL
CREATE TABLE notes (id bigserial PRIMARY KEY, organization_id text NOT NULL, body text);
INSERT INTO notes (organization_id, body) SELECT CASE WHEN g % 2 = 0 THEN 'acme' ELSE 'globex' END, 'note ' || g
  FROM generate_series(1, 10000) g;
ALTER TABLE notes OWNER TO app;
SQL
"$LOKADB" enable notes --cloud "$CLOUD_DSN" 2>&1 | tail -n 4 | sed 's/^/    /'
echo "  notes is now partitioned; id stays unique across organizations through a key map:"
su_psql -d app -At -c "SELECT '    partitions: ' || string_agg(c.relname, ', ') FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'notes'::regclass"
app_sql "INSERT INTO notes (id, organization_id, body) VALUES (2, 'globex', 'same id, other org')" 2>&1 |
    sed 's/^/    /' || true
say "statement analysis: the proxy learned of notes from the cloud's NOTIFY and places each statement"
for _ in $(seq 50); do grep -q 'metadata loaded.*tables=1 ' "$DEMO/proxy.log" && break; sleep 0.1; done
app_sql "SELECT count(*) FROM notes n WHERE n.organization_id = 'acme' AND n.id > 0" >/dev/null
app_sql "SELECT count(*) FROM notes WHERE body LIKE 'note 1%'" >/dev/null
sleep 0.2
grep 'lokadb::route' "$DEMO/proxy.log" | grep -E "n.organization_id = 'acme' AND n.id > 0|body LIKE 'note 1%'" |
    sed -E 's/.* (kind=.*)/    \1/' | tail -n 2
echo "    (route_log shows the route and the analysis; acme is still in the cloud, so both go there)"
echo "  a COPY of a whole LokaDB table out is refused, with the form that works:"
app_sql "COPY notes TO STDOUT" 2>&1 | grep -E '^(ERROR|HINT)' | sed 's/^/    /' || true
echo "    COPY (SELECT * FROM notes WHERE organization_id = 'acme') TO STDOUT -> $(app_sql "COPY (SELECT * FROM notes WHERE organization_id = 'acme') TO STDOUT" | wc -l) rows"
say "lokadb pause acme: acme's writes wait (here at most 2 s), reads and other organizations go on"
"$LOKADB" pause acme --timeout 2s --cloud "$CLOUD_DSN" | sed 's/^/    /'
echo "    read acme: $(app_sql "SELECT count(*) FROM notes WHERE organization_id = 'acme'") rows; write globex: $(app_sql "UPDATE notes SET body = body WHERE id = 1" && echo ok)"
app_sql "UPDATE notes SET body = 'x' WHERE id = 2" 2>&1 | grep -E '^(ERROR|HINT)' | sed 's/^/    write acme: /' || true
"$LOKADB" resume acme --cloud "$CLOUD_DSN" | sed 's/^/    /'
echo "    write acme after resume: $(app_sql "UPDATE notes SET body = 'x' WHERE id = 2" && echo ok)"

say "lokadb move-org acme: acme's notes move into its own database while a writer keeps inserting"
# A writer through the proxy, one INSERT per psql call, acme and globex in turn.
ACME_BEFORE=$(app_sql "SELECT count(*) FROM notes WHERE organization_id = 'acme'")
: >"$DEMO/writer.ok"
: >"$DEMO/writer.err"
(
    i=0
    while [ ! -e "$DEMO/writer.stop" ]; do
        i=$((i + 1))
        org=acme
        [ $((i % 2)) -eq 0 ] && org=globex
        if app_sql "INSERT INTO notes (organization_id, body) VALUES ('$org', 'written during the move $i')" >/dev/null 2>>"$DEMO/writer.err"; then
            echo "$org" >>"$DEMO/writer.ok"
        fi
    done
) &
WRITER_PID=$!
# Someone else following the move: status --watch reads only the cloud.
"$LOKADB" status --watch 0.2 --cloud "$CLOUD_DSN" >"$DEMO/watch.out" 2>&1 &
WATCH_PID=$!
sleep 1
"$LOKADB" move-org acme --cloud "$CLOUD_DSN" 2>&1 | sed 's/^/    /'
kill "$WATCH_PID" 2>/dev/null || true
wait "$WATCH_PID" 2>/dev/null || true
echo "  lokadb status --watch 0.2, run beside the move, saw:"
{ grep -E '^acme: ' "$DEMO/watch.out" || echo "acme: (the move was over before a refresh)"; } |
    sed 's/ (updated .*//' | uniq | sed 's/^/    /'
sleep 1
touch "$DEMO/writer.stop"
wait "$WRITER_PID" 2>/dev/null || true
rm -f "$DEMO/writer.stop"
ACME_WRITES=$(grep -c '^acme$' "$DEMO/writer.ok" || true)
echo "  the writer inserted $ACME_WRITES acme notes and $(grep -c '^globex$' "$DEMO/writer.ok" || true) globex notes; errors: $(grep -c '^ERROR' "$DEMO/writer.err" || true)"
{ grep '^ERROR' "$DEMO/writer.err" || true; } | sort | uniq -c | sed 's/^/    /'
echo "    (a write waiting at the first move's split is rolled back with 40001, to be retried; docs/moving.md)"
echo "  acme's notes: $ACME_BEFORE before + the writer's $ACME_WRITES;"
echo "    in acme's database: $(org_psql -d acme -At -c "SELECT count(*) FROM notes")"
echo "    in the cloud: $(su_psql -d app -At -c "SELECT count(*) FROM ONLY notes__lokadb_default WHERE organization_id = 'acme'") (through the proxy, postgres_fdw still reads them: $(app_sql "SELECT count(*) FROM notes WHERE organization_id = 'acme'"))"
echo "  lokadb status:"
"$LOKADB" status --cloud "$CLOUD_DSN" | sed 's/^/    /'
echo "  lokadb verify acme:"
"$LOKADB" verify acme --cloud "$CLOUD_DSN" | sed 's/^/    /'
say "lokadb move-back acme: and back into the cloud, then folded into DEFAULT (small: the cloud keeps no partition for it)"
"$LOKADB" move-back acme --cloud "$CLOUD_DSN" 2>&1 | grep -E 'switched|verify|folded|kept|done' | sed 's/^/    /'
echo "    acme's own partitions left in the cloud: $(su_psql -d app -At -c "SELECT count(*) FROM pg_class WHERE relname LIKE 'notes\_\_lokadb\_acme%'"); its notes in DEFAULT: $(su_psql -d app -At -c "SELECT count(*) FROM ONLY notes__lokadb_default WHERE organization_id = 'acme'")"
say "lokadb split acme: acme's partitions of its own made ahead, so that its next move pauses it only at the switch"
"$LOKADB" split acme --cloud "$CLOUD_DSN" 2>&1 | sed 's/^/    /'
echo "    acme's own partitions in the cloud: $(su_psql -d app -At -c "SELECT count(*) FROM pg_class WHERE relname LIKE 'notes\_\_lokadb\_acme%'"); acme is still '$(su_psql -d app -At -c "SELECT state FROM lokadb.org WHERE id = 'acme'")'"
say "lokadb move-org acme --mode logical --profile fdw+direct: out again, through a subscription this time"
# The subscription in acme's database connects to the cloud as a REPLICATION role, never a
# superuser (its password is stored there); move-org grants it SELECT on what it copies.
org_psql -d acme -q -c "GRANT pg_create_subscription TO app"
SUB_PASSWORD="sub-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
su_psql -d app -q -c "CREATE ROLE lokadb_sub LOGIN REPLICATION PASSWORD '$SUB_PASSWORD'"
"$LOKADB" move-org acme --mode logical --profile fdw+direct --cloud "$CLOUD_DSN" \
    --cloud-from-org "host=127.0.0.1 port=$PG_PORT dbname=app user=lokadb_sub password=$SUB_PASSWORD" 2>&1 |
    tee "$DEMO/move-logical.out" | grep -E 'subscription|switched|verify|done' | sed 's/^/    /'
echo "    (split ahead: this move had $(grep -c 'split of acme' "$DEMO/move-logical.out" || true) split lines)"

say "the direct path: acme's plain reads and simple updates go straight to its database"
for _ in $(seq 50); do grep -q 'metadata loaded.*organizations=1 ' "$DEMO/proxy.log" && break; sleep 0.1; done
ACME_ID=$(app_sql "SELECT min(id) FROM notes WHERE organization_id = 'acme'")
"$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=1 "$PROXY_DSN" >"$DEMO/direct.out" <<SQL
SELECT count(*) FROM notes WHERE organization_id = 'acme' AND id > 0;
BEGIN;
SELECT body FROM notes WHERE organization_id = 'acme' AND id = $ACME_ID;
UPDATE notes SET body = 'written directly' WHERE organization_id = 'acme' AND id = $ACME_ID;
COMMIT;
SELECT count(*) FROM notes n JOIN pg_class c ON c.relname = 'notes' WHERE n.organization_id = 'acme';
SELECT n.id, n.body, c.relname FROM notes n LEFT JOIN pg_class c ON c.relname = n.body WHERE n.organization_id = 'acme' ORDER BY n.id DESC LIMIT 3;
SELECT body FROM notes WHERE id = $ACME_ID;
SQL
sleep 0.2
grep 'lokadb::route' "$DEMO/proxy.log" | grep -E "AND id > 0|AND id = $ACME_ID|JOIN pg_class c ON|FROM notes WHERE id = $ACME_ID" |
    sed -E 's/rewritten="true" (statement=)/\1[sent rewritten] /; s/.*route="([a-z]*)".* kind="([a-z]*)".* statement=(.*)/    \1  \3/' | tail -n 6
echo "    in acme's database: $(org_psql -d acme -At -c "SELECT body FROM notes WHERE id = $ACME_ID")"
echo "    (BEGIN went with the SELECT, the UPDATE passed the cloud's pause gate; the joins name a"
echo "     cloud catalog table, so they went through the cloud; the feed's ORDER BY and LIMIT were"
echo "     put next to acme's table in a subquery, so acme's database sorts; for the lookup by id alone"
echo "     the cloud's key map said acme, so it went to acme's database too. Rules: docs/routing.md)"
echo "  update-then-insert (an audit row): the UPDATE goes direct, the INSERT needs the cloud, so the"
echo "  transaction moves to the cloud whole (its statements run again there, answers compared):"
"$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=1 "$PROXY_DSN" >"$DEMO/mixed.out" <<SQL ||
BEGIN;
UPDATE notes SET body = 'audited' WHERE organization_id = 'acme' AND id = $ACME_ID;
INSERT INTO notes (organization_id, body) VALUES ('acme', 'audit of note $ACME_ID');
COMMIT;
SQL
    die "an update-then-insert transaction through the proxy failed"
sleep 0.2
grep 'lokadb::route' "$DEMO/proxy.log" | grep 'route="moved"' | tail -n 1 | sed -E 's/.*(route="moved".*)/    \1/'
echo "    in acme's database: note $ACME_ID is '$(org_psql -d acme -At -c "SELECT body FROM notes WHERE id = $ACME_ID")'," \
    "audit rows: $(org_psql -d acme -At -c "SELECT count(*) FROM notes WHERE body = 'audit of note $ACME_ID'")"
echo "  a session that says its organization once (SET lokadb.org), then names none:"
SESSION_COUNT=$("$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=1 "$PROXY_DSN" -c "SET lokadb.org = 'acme'" -c "SELECT count(*) FROM notes") ||
    die "a session with lokadb.org set failed"
echo "    SELECT count(*) FROM notes -> $SESSION_COUNT: acme's rows ($(app_sql 'SELECT count(*) FROM notes') in a session without it)"
sleep 0.2
grep 'lokadb::route' "$DEMO/proxy.log" | grep 'current_setting' | tail -n 1 |
    sed -E 's/rewritten="true" (statement=)/\1[sent limited] /; s/.*route="([a-z]*)".* kind="([a-z]*)".* statement=(.*)/    \1  \3/'
OTHER_ORG=$("$PG_BIN/psql" -X -q -At "$PROXY_DSN" -c "SET lokadb.org = 'acme'" \
    -c "SELECT count(*) FROM notes WHERE organization_id = 'globex'" 2>&1 | sed -n 's/^ERROR: *//p' || true)
echo "    naming another organization: $OTHER_ORG"
STARTUP_COUNT=$(PGOPTIONS='-c lokadb.org=globex' "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=1 "$PROXY_DSN" \
    -c "SELECT count(*) FROM notes") || die "a session limited by its startup options failed"
echo "    or from its start, PGOPTIONS='-c lokadb.org=globex': SELECT count(*) FROM notes -> $STARTUP_COUNT (globex's rows)"
echo "  the cloud learns each statement's organization ahead of it (lokadb.statement_org), for its"
echo "  triggers, policies and audits; here a cloud function reads it inside the statement:"
su_psql -d app -q -c "CREATE OR REPLACE FUNCTION demo_seen_org() RETURNS text LANGUAGE sql VOLATILE
    AS \$\$ SELECT coalesce(nullif(current_setting('lokadb.statement_org', true), ''), '(none)') \$\$"
"$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=1 "$PROXY_DSN" \
    -c "SELECT 'a statement on globex: the cloud saw ' || demo_seen_org() FROM notes WHERE organization_id = 'globex' LIMIT 1" \
    -c "SELECT 'a statement on acme: the cloud saw ' || demo_seen_org() FROM notes WHERE organization_id = 'acme' LIMIT 1" \
    -c "SELECT 'a statement on every organization: the cloud saw ' || demo_seen_org() FROM notes LIMIT 1" |
    sed 's/^/    /' || die "reading lokadb.statement_org through the proxy failed"
say "migrations through the proxy, as app (the table's owner), written as Django writes them: acme's own database follows (docs/migrations.md)"
# A NOT NULL column added with a default that fills the rows and is dropped again, an index;
# then a type change with Django's USING; then the default back for the demo's writers.
"$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 "$PROXY_DSN" <<'SQL' || die "the migrations through the proxy failed"
BEGIN;
ALTER TABLE notes ADD COLUMN priority int DEFAULT 0 NOT NULL;
ALTER TABLE notes ALTER COLUMN priority DROP DEFAULT;
CREATE INDEX notes_priority_idx ON notes (priority);
COMMIT;
ALTER TABLE notes ALTER COLUMN priority TYPE bigint USING priority::bigint;
ALTER TABLE notes ALTER COLUMN priority SET DEFAULT 0;
SQL
# The proxy commits the transaction prepared in acme's database once the cloud committed.
for _ in $(seq 100); do
    [ "$(org_psql -d acme -At -c 'SELECT count(*) FROM pg_prepared_xacts')" = 0 ] && break
    sleep 0.1
done
echo "    acme's notes now: $(org_psql -d acme -At -c "SELECT string_agg(attname || ' ' || format_type(atttypid, atttypmod), ', ' ORDER BY attnum) FROM pg_attribute WHERE attrelid = 'notes'::regclass AND attnum > 0 AND NOT attisdropped"); index notes_priority_idx: $(org_psql -d acme -At -c "SELECT CASE WHEN to_regclass('notes_priority_idx') IS NULL THEN 'missing' ELSE 'built' END")"
echo "    through the proxy: $(app_sql "SELECT count(*) FROM notes WHERE organization_id = 'acme' AND priority = 0") acme notes with priority 0"
say "a deploy while acme's database cannot be reached (its agent stopped), with lokadb.migration_offline = defer"
kill "$AGENT_PID" 2>/dev/null; wait "$AGENT_PID" 2>/dev/null || true
"$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 "$PROXY_DSN" 2>&1 <<'SQL' | sed 's/^/    /' || die "the deferred migration failed"
SET lokadb.migration_offline = defer;
ALTER TABLE notes ADD COLUMN pinned boolean NOT NULL DEFAULT false;
SQL
echo "    owed: $(su_psql -d app -At -c "SELECT org || ' owes ' || count(*) || ' migration(s)' FROM lokadb.ddl_owed GROUP BY org")"
refused=""
for _ in $(seq 100); do
    refused="$("$PG_BIN/psql" -X -At "$PROXY_DSN" -c "SELECT count(*) FROM notes WHERE organization_id = 'acme'" 2>&1 || true)"
    [[ "$refused" == *"has not received"* ]] && break
    sleep 0.1
done
[[ "$refused" == *"has not received"* ]] || die "acme's statements were not refused while it owed a migration: $refused"
echo "    acme's statements meanwhile: $(head -1 <<<"$refused")"
echo "    globex's: $(app_sql "SELECT count(*) FROM notes WHERE organization_id = 'globex' AND NOT pinned") notes, served"
start_agent
served=""
for _ in $(seq 300); do
    served="$("$PG_BIN/psql" -X -At "$PROXY_DSN" -c "SELECT count(*) FROM notes WHERE organization_id = 'acme' AND NOT pinned" 2>/dev/null || true)"
    [[ -n "$served" ]] && break
    sleep 0.1
done
[[ -n "$served" ]] || die "acme did not get the migration it owed within 30 s of its agent's return (see .demo/proxy.log)"
echo "    agent back: the proxy applied what acme owed; $served acme notes, none pinned (lokadb org sync acme does it by hand)"
echo "  acme's point reads, fdw against fdw+direct (pgbench, 1 client, 3 s each, simple protocol):"
cat >"$DEMO/acme-read.sql" <<'SQL'
\set id random(1, 10000)
SELECT body FROM notes WHERE organization_id = 'acme' AND id = :id;
SQL
for profile in fdw fdw+direct; do
    su_psql -d app -q -c "UPDATE lokadb.org SET profile = '$profile' WHERE id = 'acme'"
    sleep 0.3
    "$PG_BIN/pgbench" -n -f "$DEMO/acme-read.sql" -c 1 -T 3 "$PROXY_DSN" >"$DEMO/pgbench-acme-$profile.log" 2>&1 ||
        { cat "$DEMO/pgbench-acme-$profile.log" >&2; die "pgbench of acme's reads ($profile) failed"; }
    printf '    %-10s %.0f tps, latency average %s ms\n' "$profile" \
        "$(sed -n 's/^tps = \([0-9.]*\) .*/\1/p' "$DEMO/pgbench-acme-$profile.log")" \
        "$(sed -n 's/^latency average = \([0-9.]*\) ms/\1/p' "$DEMO/pgbench-acme-$profile.log")"
done
echo

say "the operator's view: the console (database lokadb, admin_users), GET /metrics, a reload"
CONSOLE_DSN="host=127.0.0.1 port=$PROXY_PORT user=ops password=$OPS_PASSWORD dbname=lokadb"
"$PG_BIN/psql" -X -q "$PROXY_DSN" -c "SELECT pg_sleep(3)" >/dev/null 2>&1 &
SLEEPER=$!
sleep 1.5
"$PG_BIN/psql" -X "$CONSOLE_DSN" -c "SHOW CLIENTS" -c "SHOW POOLS" -c "SHOW ORGS" 2>&1 | sed 's/^/    /' ||
    die "the console did not answer"
wait "$SLEEPER" || true
# A statement that fails: one log line with the fields an operator filters on.
"$PG_BIN/psql" -X -q "$PROXY_DSN" -c "SELECT 1 / 0" >/dev/null 2>&1 || true
for _ in $(seq 50); do
    grep -q "statement error" "$DEMO/proxy.log" && break
    sleep 0.1
done
echo "    the proxy's log line for a failed statement:"
grep -m 1 "statement error" "$DEMO/proxy.log" | sed 's/^/      /' ||
    die "no 'statement error' line in .demo/proxy.log"
curl -sf "http://127.0.0.1:$METRICS_PORT/metrics" | grep -E '^lokadb_(requests_total|sessions_total|relay_organizations_connected)' | sed 's/^/    /' ||
    die "GET /metrics did not answer"
echo "    per organization (statements by route, what the demo ran so far):"
curl -sf "http://127.0.0.1:$METRICS_PORT/metrics" | grep -E '^lokadb_org_statements_total' | grep -v ' 0$' | sed 's/^/      /' ||
    die "GET /metrics has no figures per organization"
sed -i 's/"route_log": true/"route_log": false/' "$DEMO/lokadb.json"
kill -HUP "$PROXY_PID"
for _ in $(seq 100); do
    grep -q "configuration reloaded" "$DEMO/proxy.log" && break
    sleep 0.1
done
grep -q "configuration reloaded" "$DEMO/proxy.log" || die "SIGHUP did not reload the configuration (see .demo/proxy.log)"
echo "    kill -HUP: configuration reloaded (route_log off for new sessions)"
echo

say "a restart that refuses no client: a new lokadb process takes the listening sockets (handover)"
cat >"$DEMO/connect-read.sql" <<'SQL'
SELECT 1;
SQL
"$PG_BIN/pgbench" -n -C -c 4 -T 4 -f "$DEMO/connect-read.sql" "$PROXY_DSN" >"$DEMO/pgbench-handover.log" 2>&1 &
BENCH=$!
sleep 1
OLD_PID="$PROXY_PID"
LOKADB_LOG=info setsid "$LOKADB" proxy --config "$DEMO/lokadb.json" >>"$DEMO/proxy.log" 2>&1 </dev/null &
PROXY_PID=$!
echo "$PROXY_PID" >"$DEMO/proxy.pid"
for _ in $(seq 300); do kill -0 "$OLD_PID" 2>/dev/null || break; sleep 0.1; done
kill -0 "$OLD_PID" 2>/dev/null && die "the old proxy (pid $OLD_PID) did not hand over and exit (see .demo/proxy.log)"
wait "$BENCH" || { cat "$DEMO/pgbench-handover.log" >&2; die "pgbench failed across the handover"; }
echo "    pid $OLD_PID handed its sockets to pid $PROXY_PID, drained and exited; pgbench -C meanwhile:" \
    "$(sed -n 's/^number of transactions actually processed: //p' "$DEMO/pgbench-handover.log") connections served," \
    "$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' "$DEMO/pgbench-handover.log") failed"
served=""
for _ in $(seq 100); do
    served="$("$PG_BIN/psql" -X -At "$PROXY_DSN" -c "SELECT count(*) FROM notes WHERE organization_id = 'acme'" 2>/dev/null || true)"
    [[ -n "$served" ]] && break
    sleep 0.1
done
[[ -n "$served" ]] || die "acme is not served after the handover (see .demo/proxy.log, .demo/agent.log)"
echo "    acme's agent followed the relay to the new process: $served acme notes"
echo

FAILED=0
echo "LokaDB is running:"
echo "  proxy : $PROXY_ADDR   (log: $DEMO/proxy.log)"
echo "  cloud : 127.0.0.1:$PG_PORT (PostgreSQL 18, data: $DEMO/pgdata)"
echo "  relay : agents 127.0.0.1:$RELAY_AGENTS_PORT, postgres 127.0.0.1:$RELAY_PG_PORT (inside the proxy)"
echo "  acme  : 127.0.0.1:$ORG_PORT behind agent pid $AGENT_PID (log: $DEMO/agent.log)"
echo "  console: $PG_BIN/psql \"$CONSOLE_DSN\" -c 'SHOW CLIENTS'"
echo "  metrics: curl http://127.0.0.1:$METRICS_PORT/metrics"
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
