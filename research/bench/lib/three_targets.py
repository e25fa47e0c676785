"""run.py's world, also headline.py's, overload.py's and restart.py's: one PostgreSQL cluster
with the documents of ORGS organizations, the LokaDB proxy with its defaults and PgBouncer in
transaction mode (World), pgbench through each of the three targets (Bench), and the
reference's and goal's figures of the proxy core. Its LokaDB binary is
$LOKADB_BENCH_TARGET/lokadb, default target/release (not binaries.LOKADB_BIN's default)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psycopg

from .binaries import PG_BIN, REPO
from .clusters import wait_accepting
from .pgbench import parse_pgbench, pgbench_errors, read_txn_logs
from .procs import (
    CHILDREN, CLK_TCK, PG_USER, cpu_ticks, delta, free_port, ignore_signals, log, rss_kib, run_captured,
    run_checked, safe_cleanup, temp_dir,
)
from .results import fatal


LOKADB_BIN = Path(os.environ.get("LOKADB_BENCH_TARGET", REPO / "target" / "release")) / "lokadb"
PGBOUNCER_BIN = Path("/usr/sbin/pgbouncer")

APP_PASSWORD = "app-bench-secret"
AUTH_PASSWORD = "lokadb-auth-bench-secret"
SUPER_PASSWORD = "postgres-bench-secret"
ORGS = 100

TARGETS = ["direct", "lokadb", "pgbouncer"]
PROXIES = ["lokadb", "pgbouncer"]


# --------------------------------------------------------------------------------------
# Modes


class Mode:
    def __init__(self, quick: bool):
        self.quick = quick
        self.name = "quick" if quick else "full"
        self.rows = 50_000 if quick else 200_000
        self.reps = 1 if quick else 3
        self.t_latency = 1 if quick else 6  # one client, -T seconds
        self.t_throughput = 1 if quick else 8  # 32 clients
        self.t_connect = 1 if quick else 8  # -C, 16 clients
        self.t_warmup = 1 if quick else 3
        self.idle_clients = 1000
        # LokaDB's pool_mode ("session": its default; "transaction": pool_size 32, as
        # PgBouncer's pool) and the app role's SCRAM iterations (Postgres' default 4096; a
        # low count keeps the client's hashing from dominating connect-per-transaction).
        self.pool_mode = "session"
        self.scram_iterations = 4096


SCRIPTS = {
    "read": (
        "\\set id random(1, {rows})\n"
        "SELECT id, organization_id, title, updated_at FROM documents WHERE id = :id;\n"
    ),
    "feed": (
        "\\set org random(1, {orgs})\n"
        "SELECT id, title, updated_at FROM documents WHERE organization_id = :org "
        "ORDER BY id DESC LIMIT 20;\n"
    ),
    "insert": (
        "\\set org random(1, {orgs})\n"
        "INSERT INTO documents (organization_id, title, body) "
        "VALUES (:org, 'bench title', 'bench body of a new document');\n"
    ),
    "update": (
        "\\set id random(1, {rows})\n"
        "UPDATE documents SET title = 'updated title', updated_at = now() WHERE id = :id;\n"
    ),
}
QUERY_MODES = ["simple", "prepared"]


# --------------------------------------------------------------------------------------
# The world: Postgres, LokaDB proxy, PgBouncer


class World:
    def __init__(self, mode: Mode, commands: list):
        self.mode = mode
        self.commands = commands  # setup commands, recorded in raw.json
        self.tmp = temp_dir("lokadb-bench-")
        shutil.chown(self.tmp, PG_USER, PG_USER)
        self.pg_port = None
        self.pg = None
        self.proxy = None
        self.proxy_port = None
        self.bouncer = None
        self.bouncer_port = None
        self.proxy_rss_at_start = None
        self.bouncer_rss_at_start = None

    def _popen_pg_user(self, cmd, logfile: Path, **kw) -> subprocess.Popen:
        self.commands.append(f"(as {PG_USER}) {shlex.join(map(str, cmd))}")
        out = open(logfile, "ab")
        shutil.chown(logfile, PG_USER, PG_USER)
        return subprocess.Popen(
            [str(c) for c in cmd],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            user=PG_USER,
            group=PG_USER,
            extra_groups=[],
            cwd=self.tmp,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(self.tmp)},
            start_new_session=True,
            **kw,
        )

    # --- Postgres -----------------------------------------------------------------------
    def start_postgres(self) -> None:
        data = self.tmp / "pgdata"
        pwfile = self.tmp / "pwfile"
        pwfile.write_text(SUPER_PASSWORD + "\n")
        shutil.chown(pwfile, PG_USER, PG_USER)
        os.chmod(pwfile, 0o600)
        cmd = [
            PG_BIN / "initdb", "-D", data, "-U", "postgres", f"--pwfile={pwfile}",
            "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8",
            "--locale=C.UTF-8", "--no-instructions",
        ]
        self.commands.append(f"(as {PG_USER}) {shlex.join(map(str, cmd))}")
        run_checked(
            [str(c) for c in cmd], user=PG_USER, group=PG_USER, extra_groups=[], cwd=self.tmp,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        )
        pwfile.unlink()
        self.pg_port = free_port()
        settings = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.pg_port),
            "unix_socket_directories": str(self.tmp),
            "max_connections": "1200",
            "password_encryption": "scram-sha-256",
            "synchronous_commit": "off",
            "shared_buffers": "256MB",
            "logging_collector": "off",
        }
        cmd = [PG_BIN / "postgres", "-D", data]
        for k, v in settings.items():
            cmd += ["-c", f"{k}={v}"]
        self.pg = self._popen_pg_user(cmd, self.tmp / "postgres.log")
        self.pg._bench_stop_signal = signal.SIGINT  # fast shutdown
        CHILDREN.append(self.pg)
        wait_accepting(self.superuser_conn, self.pg, 60,
                       lambda: "Postgres did not start:\n" + (self.tmp / "postgres.log").read_text())

    def superuser_conn(self, dbname="postgres"):
        return psycopg.connect(
            host="127.0.0.1", port=self.pg_port, user="postgres", password=SUPER_PASSWORD,
            dbname=dbname, sslmode="disable", autocommit=True,
        )

    def app_conn(self, port=None):
        return psycopg.connect(
            host="127.0.0.1", port=port or self.pg_port, user="app", password=APP_PASSWORD,
            dbname="app", sslmode="disable", autocommit=True, connect_timeout=30,
        )

    def create_roles_and_data(self) -> dict:
        with self.superuser_conn() as c:
            c.execute("SET password_encryption = 'scram-sha-256'")
            c.execute(f"SET scram_iterations = {int(self.mode.scram_iterations)}")
            c.execute(f"CREATE ROLE app LOGIN PASSWORD '{APP_PASSWORD}'")
            c.execute(f"CREATE ROLE lokadb_auth LOGIN SUPERUSER PASSWORD '{AUTH_PASSWORD}'")
            c.execute("CREATE DATABASE app OWNER app")
            self.app_verifier = c.execute(
                "SELECT rolpassword FROM pg_authid WHERE rolname = 'app'"
            ).fetchone()[0]
            version = c.execute("SELECT version()").fetchone()[0]
        t0 = time.time()
        with self.app_conn() as c:
            c.execute(
                """CREATE TABLE documents (
                       id bigserial PRIMARY KEY,
                       organization_id int NOT NULL,
                       title text,
                       body text,
                       updated_at timestamptz DEFAULT now())"""
            )
            c.execute(
                f"""INSERT INTO documents (organization_id, title, body)
                    SELECT 1 + (i % {ORGS}), 'document ' || i, repeat(md5(i::text), 6)
                    FROM generate_series(1, {self.mode.rows}) AS i"""
            )
            c.execute("CREATE INDEX documents_org_id ON documents (organization_id, id)")
            c.execute("VACUUM ANALYZE documents")
            n = c.execute("SELECT count(*), count(DISTINCT organization_id) FROM documents").fetchone()
        return {
            "postgres_version": version,
            "rows": n[0],
            "organizations": n[1],
            "load_seconds": round(time.time() - t0, 2),
        }

    # --- LokaDB proxy -------------------------------------------------------------------
    def start_proxy(self) -> None:
        if not LOKADB_BIN.exists():
            raise RuntimeError(f"{LOKADB_BIN} is missing: build it first (cargo build --release)")
        cfg = {
            "listen": "127.0.0.1:0",
            "databases": {
                "app": {
                    "cloud": f"host=127.0.0.1 port={self.pg_port} dbname=app",
                    "auth_user": "lokadb_auth",
                    "auth_password": AUTH_PASSWORD,
                }
            },
        }
        if self.mode.pool_mode == "transaction":
            cfg["databases"]["app"].update(pool_mode="transaction", pool_size=32)
        cfg_path = self.tmp / "lokadb.json"
        cfg_path.write_text(json.dumps(cfg, indent=2))
        env = dict(os.environ)
        env["LOKADB_LOG"] = "warn"
        env.pop("LOKADB_CORES", None)  # default: all cores
        cmd = [str(LOKADB_BIN), "proxy", "--config", str(cfg_path)]
        self.commands.append("LOKADB_LOG=warn " + shlex.join(cmd))
        self.proxy_stderr = self.tmp / "lokadb.stderr.log"
        self.proxy = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=open(self.proxy_stderr, "ab"),
            stdin=subprocess.DEVNULL, env=env, start_new_session=True, text=True,
        )
        CHILDREN.append(self.proxy)
        lines: queue.Queue = queue.Queue()

        def pump():
            for line in self.proxy.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.time() + 30
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.time()))
            except queue.Empty:
                line = None
            if line is None:
                raise RuntimeError(
                    "lokadb proxy did not print its listening line:\n"
                    + self.proxy_stderr.read_text(errors="replace")[-4000:]
                )
            m = re.search(r"lokadb proxy listening on (\S+):(\d+)", line)
            if m:
                self.proxy_port = int(m.group(2))
                break
        self.proxy_rss_at_start = rss_kib(self.proxy.pid)

    # --- PgBouncer ----------------------------------------------------------------------
    def start_pgbouncer(self, pool_size: int = 32) -> None:
        """PgBouncer in transaction mode with a pool of pool_size per database and user: 32, the
        clients of the throughput runs, as many backends as LokaDB's session pooling holds then."""
        self.bouncer_port = free_port()
        self.bouncer_ini = self.tmp / "pgbouncer.ini"
        auth_file = self.tmp / "userlist.txt"
        auth_file.write_text(f'"app" "{self.app_verifier}"\n')
        ini = self.bouncer_ini
        ini.write_text(
            "[databases]\n"
            f"app = host=127.0.0.1 port={self.pg_port} dbname=app\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.bouncer_port}\n"
            "unix_socket_dir =\n"
            "pool_mode = transaction\n"
            "auth_type = scram-sha-256\n"
            f"auth_file = {auth_file}\n"
            f"default_pool_size = {pool_size}\n"
            "max_client_conn = 2000\n"
            "ignore_startup_parameters = extra_float_digits\n"
            f"logfile = {self.tmp / 'pgbouncer.log'}\n"
            f"pidfile = {self.tmp / 'pgbouncer.pid'}\n"
            "log_connections = 0\n"
            "log_disconnections = 0\n"
            "log_pooler_errors = 1\n"
        )
        for f in (auth_file, ini):
            shutil.chown(f, PG_USER, PG_USER)
            os.chmod(f, 0o600)
        self.bouncer = self._popen_pg_user([PGBOUNCER_BIN, ini], self.tmp / "pgbouncer.stdout.log")
        self.bouncer._bench_stop_signal = signal.SIGINT
        CHILDREN.append(self.bouncer)
        deadline = time.time() + 30
        while True:
            try:
                with self.app_conn(self.bouncer_port) as c:
                    c.execute("SELECT 1")
                break
            except psycopg.OperationalError as e:
                if self.bouncer.poll() is not None or time.time() > deadline:
                    logs = ""
                    for name in ("pgbouncer.log", "pgbouncer.stdout.log"):
                        p = self.tmp / name
                        if p.exists():
                            logs += p.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"PgBouncer did not start: {e}\n{logs}")
                time.sleep(0.2)
        self.bouncer_rss_at_start = rss_kib(self.bouncer.pid)

    def ensure_alive(self) -> list[str]:
        """Restart a proxy that died (and say so): every later run would fail otherwise."""
        events = []
        if self.pg.poll() is not None:
            raise RuntimeError(f"Postgres exited with code {self.pg.returncode}")
        if self.proxy.poll() is not None:
            rc = self.proxy.returncode
            tail = self.proxy_stderr.read_text(errors="replace")[-2000:]
            how = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
            CHILDREN.remove(self.proxy)
            old = self.proxy.pid
            self.start_proxy()
            events.append(f"LokaDB proxy pid {old} died ({how}); stderr tail: {tail.strip()[-500:]!r}; "
                          f"restarted as pid {self.proxy.pid} on port {self.proxy_port}")
        if self.bouncer.poll() is not None:
            rc = self.bouncer.returncode
            how = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
            CHILDREN.remove(self.bouncer)
            old = self.bouncer.pid
            self.start_pgbouncer()
            events.append(f"PgBouncer pid {old} died ({how}); restarted as pid {self.bouncer.pid}")
        for e in events:
            log("WARNING: " + e)
        return events

    def port_of(self, target: str) -> int:
        return {"direct": self.pg_port, "lokadb": self.proxy_port, "pgbouncer": self.bouncer_port}[
            target
        ]

    def pid_of(self, target: str):
        return {"lokadb": self.proxy.pid, "pgbouncer": self.bouncer.pid}.get(target)

    def alive(self) -> dict:
        return {
            "postgres": self.pg.poll() is None,
            "lokadb": self.proxy.poll() is None,
            "pgbouncer": self.bouncer.poll() is None,
        }


# --------------------------------------------------------------------------------------
# pgbench through each


class Bench:
    def __init__(self, world: World, mode: Mode, workdir: Path):
        self.w = world
        self.mode = mode
        self.workdir = workdir
        self.runs: list[dict] = []
        self.events: list[str] = []
        self.script_files = {}
        for name, body in SCRIPTS.items():
            p = workdir / f"{name}.sql"
            p.write_text(body.format(rows=mode.rows, orgs=ORGS))
            self.script_files[name] = p

    def pgbench(self, *, phase, kind, scenario, script, qmode, target, clients, threads, seconds,
                connect_each=False, rep=None, log_txns=True, extra=()) -> dict:
        """One pgbench run, recorded. log_txns: with -l (per-transaction log, read for p50/p99);
        the log costs pgbench CPU per transaction, taken from the same cores (headline.py)."""
        self.events.extend(self.w.ensure_alive())
        port = self.w.port_of(target)
        logdir = Path(tempfile.mkdtemp(prefix="pgblog-", dir=self.workdir))
        prefix = logdir / "txn"
        cmd = [
            str(PG_BIN / "pgbench"), "-n", "-h", "127.0.0.1", "-p", str(port), "-U", "app",
            "-M", qmode, "-f", str(self.script_files[script]), "-c", str(clients),
            "-j", str(threads), "-T", str(seconds),
        ]
        if log_txns:
            cmd += ["-l", f"--log-prefix={prefix}"]
        cmd += list(extra)
        if connect_each:
            cmd.append("-C")
        cmd.append("app")
        env = dict(os.environ, PGPASSWORD=APP_PASSWORD, PGSSLMODE="disable")
        pids = {t: self.w.pid_of(t) for t in PROXIES}
        before = {t: cpu_ticks(pid) for t, pid in pids.items()}
        load_before = Path("/proc/loadavg").read_text().split()[0]
        t0 = time.time()
        rec = {
            "phase": phase, "phase_kind": kind, "scenario": scenario, "script": script, "query_mode": qmode,
            "target": target, "clients": clients, "threads": threads, "seconds": seconds,
            "connect_each": connect_each, "rep": rep, "log_txns": log_txns, "extra": list(extra),
            "command": "PGPASSWORD=*** PGSSLMODE=disable " + shlex.join(cmd),
        }
        try:
            stdout, stderr, rc, timed_out = run_captured(cmd, seconds + 90, env=env, cwd=logdir)
        except Exception as e:  # pragma: no cover
            stdout, stderr, rc, timed_out = "", repr(e), -1, False
        wall = time.time() - t0
        after = {t: cpu_ticks(pid) for t, pid in pids.items()}
        rec.update(parse_pgbench(stdout))
        rec.update(read_txn_logs(prefix))
        rec["returncode"] = rc
        rec["wall_seconds"] = round(wall, 3)
        rec["cpu_ticks"] = {t: delta(before[t], after[t]) for t in PROXIES}
        rec["loadavg_1min_before_after"] = [load_before, Path("/proc/loadavg").read_text().split()[0]]
        rec["clk_tck"] = CLK_TCK
        tx = rec.get("transactions") or 0
        rec["cpu_us_per_txn"] = {
            t: (round(rec["cpu_ticks"][t] / CLK_TCK * 1e6 / tx, 2)
                if tx and rec["cpu_ticks"][t] is not None else None)
            for t in PROXIES
        }
        pgbench_errors(rec, stdout, stderr, rc, timed_out, seconds + 90)
        rec["ok"] = bool(tx) and rc == 0 and not timed_out
        rec["alive_after"] = self.w.alive()
        if not all(rec["alive_after"].values()):
            dead = [k for k, v in rec["alive_after"].items() if not v]
            rec["error"] = (rec.get("error", "") + "; " if rec.get("error") else "") + f"{dead} died during this run"
            if target in dead or "postgres" in dead:
                rec["ok"] = False
        shutil.rmtree(logdir, ignore_errors=True)
        self.runs.append(rec)
        status = "ok" if rec["ok"] else f"ERROR ({rec['error']})"
        p50 = rec.get("p50_ms")
        log(
            f"  {scenario:<22} {target:<9} tps={rec.get('tps')} p50={p50}ms "
            f"p99={rec.get('p99_ms')}ms tx={tx} cpu(lokadb,pgb)="
            f"{rec['cpu_ticks']['lokadb']},{rec['cpu_ticks']['pgbouncer']} ticks  {status}"
        )
        if not rec["ok"] and stderr.strip():
            for line in stderr.strip().splitlines()[-3:]:
                log(f"      {line}")
        return rec


def three_targets(mode, meta: dict, raw: dict, measure) -> int:
    """The world of this script for a side-by-side pgbench harness (headline.py, overload.py):
    Postgres with the documents, LokaDB with its defaults, PgBouncer in transaction mode with a
    pool of 32; measure(bench) runs the scenarios. Every process is stopped afterwards, also on
    an error or a signal. Fills raw["runs"], meta's errors, pgbouncer_ini and lokadb_command;
    returns the exit code."""
    commands = meta["setup_commands"]
    meta.setdefault("pgbouncer_ini", "")
    meta.setdefault("lokadb_command", "")
    bench = None
    code = 0
    try:
        world = World(mode, commands)
        log("initdb + start PostgreSQL 18")
        world.start_postgres()
        meta["data"] = world.create_roles_and_data()
        world.start_proxy()
        world.start_pgbouncer(pool_size=32)
        meta["pgbouncer_ini"] = world.bouncer_ini.read_text()
        meta["lokadb_command"] = next((c for c in commands if " proxy --config " in c), "")
        bench = Bench(world, mode, world.tmp)
        measure(bench)
    except KeyboardInterrupt as e:
        meta["errors"].append(f"interrupted: {e}")
        code = 130
    except Exception as e:  # noqa: BLE001
        code = fatal(meta["errors"], e)
    finally:
        ignore_signals()
        safe_cleanup()
    if bench is not None:
        raw["runs"] = bench.runs
        meta["errors"].extend(bench.events)
        meta["errors"].extend(f"{r['scenario']} via {r['target']} (rep {r['rep']}): {r['error']}"
                              for r in bench.runs if r.get("error"))
    return code


def rotated(rep: int) -> list[str]:
    k = rep % len(TARGETS)
    return TARGETS[k:] + TARGETS[:k]


# --------------------------------------------------------------------------------------
# The binary


def binary_info() -> dict:
    h = hashlib.sha256()
    with open(LOKADB_BIN, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    st = LOKADB_BIN.stat()
    return {
        "path": str(LOKADB_BIN),
        "sha256": h.hexdigest(),
        "mtime_utc": dt.datetime.fromtimestamp(st.st_mtime, dt.timezone.utc).isoformat(),
        "size": st.st_size,
    }


# --------------------------------------------------------------------------------------
# The reference's figures and the goals


# run.py's charts. The reference (shared/seed/performance-reference.txt, "Organizations that stay
# in the cloud" and "A new connection for every request"; RESULTS.md's overview, rows "Proxy
# overhead", "One client" and "A new connection per request"): LokaDB ÷ direct with 32 clients,
# its ops/s divided (read 29,799 ÷ 66,496, feed 28,375 ÷ 35,526, update 33,880 ÷ 57,166, insert
# 8,612 ÷ 23,673); with a new connection per request 2,795 ÷ 1,321 requests/s; p50 added, one
# client (read 0.25 → 0.61 ms, feed 0.12 → 0.29, update 0.25 → 0.46, insert 0.71 → 1.77).
REFERENCE_TPS_RATIO = {"read": 0.45, "feed": 0.80, "update": 0.59, "insert": 0.36}


REFERENCE_CONNECT_RATIO = 2.1


REFERENCE_ADDED_P50_MS = {"read": 0.36, "feed": 0.17, "update": 0.21, "insert": 1.06}
# The goals (RESULTS.md's overview, same rows): throughput ÷ direct ≥ 0.9 with 32 clients, ≥ 3
# with a new connection per request, p50 added ≤ 0.05 ms.
GOAL_TPS_RATIO = 0.9
GOAL_CONNECT_RATIO = 3.0
GOAL_ADDED_P50_MS = 0.05
