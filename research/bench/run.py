#!/usr/bin/env python3
"""LokaDB proxy-core benchmark: direct Postgres vs LokaDB proxy vs PgBouncer, side by side.

    /work/main/.venv/bin/python research/bench/run.py [--quick] [--out DIR]

Sets up its own world (a throwaway PostgreSQL 18 cluster, the LokaDB proxy, PgBouncer),
runs pgbench scenarios interleaved across the three targets, repeats them, and writes
raw.json, summary.md and PNG charts into research/bench/results/<UTC timestamp>[-quick]/,
and the numbers behind the charts into research/bench/charts-data.md.
See research/bench/README.md for the method and how to read the results.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import glob
import gzip
import hashlib
import io
import json
import os
import platform
import queue
import re
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
# LOKADB_BENCH_PG_BIN: another build (cloud_tls.py needs one with TLS: Debian's postgresql-15).
PG_BIN = Path(os.environ.get("LOKADB_BENCH_PG_BIN", REPO / ".pg" / "bin"))
LOKADB_BIN = Path(os.environ.get("LOKADB_BENCH_TARGET", REPO / "target" / "release")) / "lokadb"
PGBOUNCER_BIN = Path("/usr/sbin/pgbouncer")
PG_USER = "lokadb-pg"

APP_PASSWORD = "app-bench-secret"
AUTH_PASSWORD = "lokadb-auth-bench-secret"
SUPER_PASSWORD = "postgres-bench-secret"
ORGS = 100

TARGETS = ["direct", "lokadb", "pgbouncer"]
PROXIES = ["lokadb", "pgbouncer"]

try:
    import psycopg
except ImportError:  # pragma: no cover
    sys.exit(
        "research/bench/run.py: psycopg 3 is missing. Run it with the repo venv "
        "(/work/main/.venv/bin/python, created by scripts/setup.sh) or\n"
        "  .venv/bin/pip install -r research/bench/requirements.txt"
    )
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:  # pragma: no cover
    sys.exit(
        "research/bench/run.py: matplotlib is missing (needed for the charts). Install it with\n"
        "  /work/main/.venv/bin/pip install -r research/bench/requirements.txt"
    )


# --------------------------------------------------------------------------------------
# Modes


class Mode:
    def __init__(self, quick: bool):
        self.quick = quick
        self.name = "quick" if quick else "full"
        self.rows = 50_000 if quick else 200_000
        self.reps = 1 if quick else 3
        self.t_latency = 3 if quick else 6  # one client, -T seconds
        self.t_throughput = 3 if quick else 8  # 32 clients
        self.t_connect = 3 if quick else 8  # -C, 16 clients
        self.t_warmup = 1 if quick else 3
        self.idle_clients = 1000


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
# Process bookkeeping and cleanup

CHILDREN: list[subprocess.Popen] = []
TEMP_DIRS: list[Path] = []


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(p: subprocess.Popen, sig=signal.SIGTERM, wait=10.0) -> None:
    if p.poll() is not None:
        return
    try:
        p.send_signal(sig)
        p.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        p.kill()
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    except ProcessLookupError:
        pass


def cleanup() -> None:
    # Reverse start order: proxies first, Postgres last.
    for p in reversed(CHILDREN):
        sig = getattr(p, "_bench_stop_signal", signal.SIGTERM)
        stop_process(p, sig)
    CHILDREN.clear()
    for d in TEMP_DIRS:
        shutil.rmtree(d, ignore_errors=True)
    TEMP_DIRS.clear()


def on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def catch_signals() -> None:
    """Ctrl-C, kill and hang-up all end in the cleanup (SIGINT explicitly: a shell starting us in
    the background would otherwise have it ignored)."""
    for sig in SIGNALS:
        signal.signal(sig, on_sigterm)


def ignore_signals() -> None:
    """A second Ctrl-C must not stop the cleanup."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def safe_cleanup() -> None:
    """cleanup(), a problem logged rather than raised (it runs in a finally)."""
    try:
        cleanup()
    except Exception as e:  # pragma: no cover
        log(f"cleanup problem: {e}")


def raise_fd_limit() -> None:
    """Open files: the soft limit up to max(hard, 65536), else to the hard limit (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(hard, 65536)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def preflight(script: str, paths, hint: str = "run scripts/setup.sh and the cargo build in the README first") -> None:
    """Exits with a message unless run as root (Postgres runs as the user lokadb-pg) and every
    path in `paths` exists."""
    if os.geteuid() != 0:
        sys.exit(f"{script} must run as root (it starts Postgres as the user lokadb-pg)")
    for p in paths:
        if not Path(p).exists():
            sys.exit(f"missing {p}: {hint}")


def temp_dir(prefix: str) -> Path:
    """A temporary folder that cleanup() removes, readable by all (the Postgres user's clusters)."""
    d = Path(tempfile.mkdtemp(prefix=prefix))
    TEMP_DIRS.append(d)
    os.chmod(d, 0o755)
    return d


def run_captured(cmd, timeout: float, **kw):
    """Runs cmd in a session of its own (stopped by cleanup() while it runs), its output captured,
    killed after timeout s. Returns (stdout, stderr, returncode, timed_out)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, **kw)
    CHILDREN.append(p)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        p.kill()
        stdout, stderr = p.communicate()
        timed_out = True
    finally:
        CHILDREN.remove(p)
    return stdout, stderr, p.returncode, timed_out


def run_checked(cmd, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise RuntimeError(
            f"command failed ({r.returncode}): {shlex.join(map(str, cmd))}\n{r.stdout}\n{r.stderr}"
        )
    return r


# --------------------------------------------------------------------------------------
# /proc readings


CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int):
    """utime + stime of a whole process (all threads), in clock ticks; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    fields = data[data.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state); utime is field 14, stime field 15.
    return int(fields[11]) + int(fields[12])


def sched_ns(pid: int):
    """CPU time of a process in ns (all its threads' schedstat), finer than the 10 ms ticks; None if
    it is gone."""
    total, seen = 0, False
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return None
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
                seen = True
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            pass
    return total if seen else None


def delta(a, b):
    """b - a of two readings, None if either is (a process gone)."""
    return (b - a) if a is not None and b is not None else None


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except FileNotFoundError:
        pass
    return -1


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
        deadline = time.time() + 60
        while True:
            try:
                with self.superuser_conn():
                    break
            except psycopg.OperationalError:
                if self.pg.poll() is not None or time.time() > deadline:
                    raise RuntimeError(
                        "Postgres did not start:\n" + (self.tmp / "postgres.log").read_text()
                    )
                time.sleep(0.2)

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
# pgbench


def parse_pgbench(stdout: str) -> dict:
    out = {}
    m = re.search(r"^tps = ([\d.]+)", stdout, re.M)
    out["tps"] = float(m.group(1)) if m else None
    m = re.search(r"number of transactions actually processed: (\d+)", stdout)
    out["transactions"] = int(m.group(1)) if m else None
    m = re.search(r"number of failed transactions: (\d+)", stdout)
    out["failed_transactions"] = int(m.group(1)) if m else None
    m = re.search(r"latency average = ([\d.]+) ms", stdout)
    out["latency_avg_ms"] = float(m.group(1)) if m else None
    m = re.search(r"average connection time = ([\d.]+) ms", stdout)
    out["avg_connection_ms"] = float(m.group(1)) if m else None
    # With -R and -L (an open model): transactions never started because they were already
    # later than the limit, and those that finished over it.
    m = re.search(r"number of transactions skipped: (\d+)", stdout)
    out["skipped_transactions"] = int(m.group(1)) if m else None
    m = re.search(r"number of transactions above the [\d.]+ ms latency limit: (\d+)/(\d+)", stdout)
    out["late_transactions"] = int(m.group(1)) if m else None
    return out


def pgbench_errors(rec: dict, stdout: str, stderr: str, rc, timed_out: bool, timeout, more=(),
                   stdout_lines=25) -> list[str]:
    """What went wrong in a pgbench run (timeout, exit code, no or failed transactions, then `more`),
    recorded in rec with the tails of its output; [] if nothing did."""
    errors = []
    if timed_out:
        errors.append(f"pgbench timed out after {timeout}s and was killed")
    if rc != 0:
        errors.append(f"pgbench exit code {rc}")
    if not (rec.get("transactions") or 0):
        errors.append("no transactions processed")
    if rec.get("failed_transactions"):
        errors.append(f"{rec['failed_transactions']} failed transactions")
    errors += more
    if errors:
        rec["error"] = "; ".join(errors)
        lines = stderr.strip().splitlines()
        rec["stderr_tail"] = "\n".join(lines[-15:])
        first = next((l for l in lines if "ERROR" in l or "FATAL" in l), lines[-1] if lines else "")
        rec["first_error"] = first.strip()
        rec["stdout_tail"] = "\n".join(stdout.strip().splitlines()[-stdout_lines:])
    return errors


def percentile(sorted_vals, q: float):
    if not sorted_vals:
        return None
    k = (len(sorted_vals) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def read_txn_logs(prefix: Path) -> dict:
    lat = []
    failed = 0
    for f in glob.glob(f"{prefix}.*"):
        with open(f) as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                try:
                    lat.append(int(parts[2]))
                except ValueError:  # "failed" / "skipped"
                    failed += 1
    lat.sort()
    return {
        "logged_transactions": len(lat),
        "logged_failed": failed,
        "p50_ms": round(percentile(lat, 0.50) / 1000, 4) if lat else None,
        "p99_ms": round(percentile(lat, 0.99) / 1000, 4) if lat else None,
    }


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


def write_with_chart(raw: dict, outdir: Path, md: str, draw, alt: str, section: str) -> str:
    """summary.md: md, then the chart draw(raw, outdir) made (its file name, or None; one that
    fails is reported, not fatal); a full run without errors is also charts-data.md's section
    `section`, the chart linked from there. Returns the markdown."""
    try:
        chart = draw(raw, outdir)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        chart = None
    if chart:
        md += f"\n![{alt}]({chart})\n"
    (outdir / "summary.md").write_text(md)
    if raw["meta"]["mode"] == "full" and not raw["meta"]["errors"]:
        summary_to_charts_data(
            section, md.replace(f"]({chart})", f"](results/{raw['meta']['run_id']}/{chart})") if chart else md)
    return md


def write_raw_gz(outdir: Path, raw: dict) -> Path:
    """raw.json.gz in outdir (and no raw.json): a run's samples compressed, so that a run folder
    stays small in git."""
    path = outdir / "raw.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(raw, f, indent=1, default=str)
    (outdir / "raw.json").unlink(missing_ok=True)
    return path


def read_raw(path: Path) -> dict:
    """A run's raw.json or raw.json.gz."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def rotated(rep: int) -> list[str]:
    k = rep % len(TARGETS)
    return TARGETS[k:] + TARGETS[:k]


# --------------------------------------------------------------------------------------
# Idle clients and RSS


def idle_clients_test(world: World, target: str, n: int) -> dict:
    pid = world.pid_of(target)
    port = world.port_of(target)
    res = {"target": target, "requested_clients": n}
    res["rss_kib_idle_before"] = rss_kib(pid)
    with world.superuser_conn() as c:
        res["pg_backends_before"] = c.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = 'app'"
        ).fetchone()[0]
    conns = []
    errors: dict[str, int] = {}
    lock = threading.Lock()

    def one(_):
        try:
            c = world.app_conn(port)
            with lock:
                conns.append(c)
        except Exception as e:
            msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else repr(e)
            with lock:
                errors[msg] = errors.get(msg, 0) + 1

    t0 = time.time()
    ticks0 = cpu_ticks(pid)
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as ex:
        list(ex.map(one, range(n)))
    res["connect_seconds"] = round(time.time() - t0, 2)
    res["cpu_ticks_connecting"] = cpu_ticks(pid) - ticks0
    res["opened_clients"] = len(conns)
    res["connect_errors"] = errors
    time.sleep(2)
    # Verify a sample of them is authenticated and usable.
    sample_ok = 0
    for c in conns[:: max(1, len(conns) // 10)]:
        try:
            c.execute("SELECT 1").fetchone()
            sample_ok += 1
        except Exception:
            pass
    res["sample_checked_ok"] = sample_ok
    time.sleep(1)
    res["rss_kib_with_clients"] = rss_kib(pid)
    with world.superuser_conn() as c:
        res["pg_backends_with_clients"] = c.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = 'app'"
        ).fetchone()[0]
    for c in conns:
        try:
            c.close()
        except Exception:
            pass
    time.sleep(2)
    res["rss_kib_after_close"] = rss_kib(pid)
    if conns:
        res["rss_kib_per_idle_client"] = round(
            (res["rss_kib_with_clients"] - res["rss_kib_idle_before"]) / len(conns), 2
        )
    if errors:
        res["error"] = f"{n - len(conns)} of {n} connections failed: {errors}"
    res["cpu_us_per_connect"] = (
        round(res["cpu_ticks_connecting"] / CLK_TCK * 1e6 / len(conns), 1) if conns else None
    )
    return res


# --------------------------------------------------------------------------------------
# Summaries


def med(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def fmt(v, nd=2, suffix=""):
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:,.{nd}f}{suffix}"
    return f"{v:,}{suffix}"


def summarize(runs: list[dict], reps: int) -> dict:
    """Per scenario: medians of absolute values and medians of per-repetition ratios."""
    meas = [r for r in runs if r["phase"] == "measure"]
    scenarios = []
    for r in meas:
        if r["scenario"] not in scenarios:
            scenarios.append(r["scenario"])
    out = {}
    for sc in scenarios:
        rs = [r for r in meas if r["scenario"] == sc]
        entry = {"kind": rs[0]["phase_kind"], "script": rs[0]["script"],
                 "query_mode": rs[0]["query_mode"], "clients": rs[0]["clients"], "targets": {}}
        by_rep = {}
        for r in rs:
            by_rep.setdefault(r["rep"], {})[r["target"]] = r
        for t in TARGETS:
            tr = [r for r in rs if r["target"] == t]
            okr = [r for r in tr if r["ok"]]
            entry["targets"][t] = {
                "runs": len(tr),
                "ok_runs": len(okr),
                "errors": sorted({r.get("error", "") for r in tr if not r["ok"] or r.get("error")} - {""}),
                "first_errors": sorted({re.sub(r"client \d+ ", "", r.get("first_error", "")) for r in tr if not r["ok"]} - {""}),
                "tps": med([r["tps"] for r in okr]),
                "p50_ms": med([r["p50_ms"] for r in okr]),
                "p99_ms": med([r["p99_ms"] for r in okr]),
                "transactions": med([r["transactions"] for r in okr]),
                "cpu_us_per_txn": med([r["cpu_us_per_txn"].get(t) for r in okr]) if t in PROXIES else None,
            }
        for t in PROXIES:
            ratios, added = [], []
            for rep, d in by_rep.items():
                a, b = d.get("direct"), d.get(t)
                if a and b and a["ok"] and b["ok"]:
                    if a["tps"] and b["tps"] is not None:
                        ratios.append(b["tps"] / a["tps"])
                    if a["p50_ms"] is not None and b["p50_ms"] is not None:
                        added.append(b["p50_ms"] - a["p50_ms"])
            entry["targets"][t]["tps_ratio"] = med(ratios)
            entry["targets"][t]["tps_ratios_per_rep"] = [round(x, 4) for x in ratios]
            entry["targets"][t]["added_p50_ms"] = med(added)
            entry["targets"][t]["added_p50_per_rep"] = [round(x, 4) for x in added]
        out[sc] = entry
    return out


def status_cell(t):
    why = ""
    if t.get("first_errors"):
        why = " (" + t["first_errors"][0].replace("pgbench: error: ", "").replace("|", "/")[:120] + ")"
    if t["ok_runs"] == 0:
        return "FAILED" + why
    if t["ok_runs"] < t["runs"]:
        return f"{t['ok_runs']}/{t['runs']} ok" + why
    return ""


def summary_markdown(meta: dict, summary: dict, idle: list[dict]) -> str:
    L = []
    q = f" (QUICK MODE: short runs, R={meta['reps']} — indicative only)" if meta["mode"] == "quick" else ""
    L.append(f"# Proxy-core benchmark — {meta['run_id']}{q}\n")
    L.append(
        f"Machine: {meta['machine']['nproc']} cores, `{meta['machine']['uname']}`; "
        f"commit `{meta['git']['commit'][:12]}`{' (working tree dirty)' if meta['git']['dirty'] else ''}; "
        f"{meta['postgres']['version'].split(',')[0]}; {meta['pgbouncer_version']}; "
        f"{meta['data']['rows']:,} rows in {meta['data']['organizations']} organizations; "
        f"R={meta['reps']} repetitions, median shown; durations: 1 client {meta['durations']['latency_s']} s, "
        f"32 clients {meta['durations']['throughput_s']} s, connect-per-transaction {meta['durations']['connect_s']} s. "
        f"Load generator (pgbench), proxies and Postgres share the same {meta['machine']['nproc']} cores; "
        f"Postgres runs with synchronous_commit=off. Total run time {meta['duration_seconds']:.0f} s.\n"
    )

    L.append("## One client: p50 / p99 latency (ms) and the p50 added over direct\n")
    L.append("| scenario | direct p50 | LokaDB p50 | LokaDB added p50 | PgBouncer p50 | PgBouncer added p50 | direct p99 | LokaDB p99 | PgBouncer p99 | notes |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for sc, e in summary.items():
        if e["kind"] != "latency":
            continue
        d, l, b = (e["targets"][t] for t in TARGETS)
        notes = "; ".join(f"{t}: {status_cell(e['targets'][t])}" for t in TARGETS if status_cell(e["targets"][t]))
        L.append(
            f"| {sc} | {fmt(d['p50_ms'], 3)} | {fmt(l['p50_ms'], 3)} | {fmt(l['added_p50_ms'], 3, '')} | "
            f"{fmt(b['p50_ms'], 3)} | {fmt(b['added_p50_ms'], 3)} | {fmt(d['p99_ms'], 3)} | "
            f"{fmt(l['p99_ms'], 3)} | {fmt(b['p99_ms'], 3)} | {notes} |"
        )
    L.append("")

    def ratio_table(title, kind):
        L.append(title)
        L.append("| scenario | direct tps | LokaDB tps | LokaDB ÷ direct | PgBouncer tps | PgBouncer ÷ direct | notes |")
        L.append("|---|---:|---:|---:|---:|---:|---|")
        for sc, e in summary.items():
            if e["kind"] != kind:
                continue
            d, l, b = (e["targets"][t] for t in TARGETS)
            notes = "; ".join(f"{t}: {status_cell(e['targets'][t])}" for t in TARGETS if status_cell(e["targets"][t]))
            L.append(
                f"| {sc} | {fmt(d['tps'], 0)} | {fmt(l['tps'], 0)} | {fmt(l['tps_ratio'], 3)} | "
                f"{fmt(b['tps'], 0)} | {fmt(b['tps_ratio'], 3)} | {notes} |"
            )
        L.append("")

    ratio_table("## 32 clients (`-c 32 -j 2`): throughput, and ÷ direct\n", "throughput")
    ratio_table("## A new connection per transaction (`-C -c 16 -j 2`, point read, simple)\n", "connect")

    L.append("## CPU time per statement of the proxy process (µs, utime+stime from /proc ÷ transactions)\n")
    L.append(f"Clock tick = {1e6 / CLK_TCK:.0f} µs; one statement per transaction in every script.\n")
    L.append("| scenario | LokaDB µs/stmt | PgBouncer µs/stmt | LokaDB ÷ PgBouncer |")
    L.append("|---|---:|---:|---:|")
    for sc, e in summary.items():
        l, b = e["targets"]["lokadb"], e["targets"]["pgbouncer"]
        ratio = (l["cpu_us_per_txn"] / b["cpu_us_per_txn"]) if (l["cpu_us_per_txn"] and b["cpu_us_per_txn"]) else None
        L.append(f"| {sc} | {fmt(l['cpu_us_per_txn'], 1)} | {fmt(b['cpu_us_per_txn'], 1)} | {fmt(ratio, 2)} |")
    L.append("")

    L.append("## Memory: RSS idle and with idle authenticated clients\n")
    L.append("| target | RSS at start (MiB) | RSS before (MiB) | clients opened | RSS with clients (MiB) | KiB per idle client | RSS after close (MiB) | Postgres backends before → with clients | connect time (s) | CPU µs per connect | errors |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in idle:
        L.append(
            f"| {r['target']} | {fmt(r.get('rss_kib_at_start', 0) / 1024, 1)} | {fmt(r['rss_kib_idle_before'] / 1024, 1)} | "
            f"{r['opened_clients']}/{r['requested_clients']} | {fmt(r['rss_kib_with_clients'] / 1024, 1)} | "
            f"{fmt(r.get('rss_kib_per_idle_client'), 1)} | {fmt(r['rss_kib_after_close'] / 1024, 1)} | "
            f"{r.get('pg_backends_before')} → {r['pg_backends_with_clients']} | {fmt(r['connect_seconds'], 2)} | {fmt(r.get('cpu_us_per_connect'), 0)} | "
            f"{r.get('error', '')} |"
        )
    L.append("")
    errs = meta.get("errors") or []
    if errs:
        L.append("## Errors\n")
        for e in errs:
            L.append(f"- {e}")
        L.append("")
    L.append("Raw numbers of every run, with the exact commands: `raw.json`. Method: `research/bench/README.md`.\n")
    return "\n".join(L)


# Charts: the performance reference's figure and the goal are drawn alike on every chart of
# research/bench/ (the reference grey and dash-dotted, as django_app.py's reference band is grey;
# the goal red and dashed), each labelled "reference: …" / "goal: …" in the legend.
REFERENCE_STYLE = {"colors": "#57606a", "linestyles": "dashdot", "linewidths": 1.4}
GOAL_STYLE = {"colors": "#cf222e", "linestyles": "dashed", "linewidths": 1.2}


def save_png(fig, path: Path, dpi: int) -> None:
    """fig as a PNG of at most 256 colours (a chart has a few dozen: a third of the size of
    matplotlib's RGBA, so that run folders stay small in git)."""
    from PIL import Image  # matplotlib's own dependency

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    with Image.open(buf) as im:
        # method 0: median cut, dither 0: none (Image.Quantize / Image.Dither from Pillow 9.1 on)
        im.convert("RGB").quantize(256, method=0, dither=0).save(path, optimize=True)


def reference_line(ax, value: float, label: str, vertical: bool = False) -> None:
    """The reference's figure across the whole axes, labelled `reference: label`."""
    (ax.axvline if vertical else ax.axhline)(value, color=REFERENCE_STYLE["colors"], ls="-.",
                                             lw=REFERENCE_STYLE["linewidths"], label=f"reference: {label}")


def goal_line(ax, value: float, label: str, vertical: bool = False) -> None:
    """The goal across the whole axes, labelled `goal: label`."""
    (ax.axvline if vertical else ax.axhline)(value, color=GOAL_STYLE["colors"], ls="--",
                                             lw=GOAL_STYLE["linewidths"], label=f"goal: {label}")


def marks(ax, xs: list, ys: list, width: float, label: str, style: dict) -> None:
    """A figure per category (a bar group): a short horizontal segment `width` wide over each x
    (None skipped), one legend entry `label`; style REFERENCE_STYLE or GOAL_STYLE."""
    from matplotlib import patheffects

    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if pts:
        # A white edge: the segment stays visible over a bar of any colour.
        ax.hlines([y for _, y in pts], [x - width / 2 for x, _ in pts], [x + width / 2 for x, _ in pts],
                  label=label, zorder=3, **style,
                  path_effects=[patheffects.withStroke(linewidth=style["linewidths"] + 2.5, foreground="white")])


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


def draw_charts(outdir: Path, summary: dict, idle: list[dict], title_suffix: str) -> list[str]:
    files = []
    colors = {"lokadb": "#1f6feb", "pgbouncer": "#d29922"}
    labels = {"lokadb": "LokaDB", "pgbouncer": "PgBouncer"}

    def bars(kinds, key, fname, ylabel, title, hline=None, refs=None, value_fmt="{:.2f}", legend_loc="upper left"):
        """refs(ax, scs, width): draws the reference's and the goal's figures."""
        scs = [sc for sc, e in summary.items() if e["kind"] in kinds]
        if not scs:
            return
        fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(scs) + 2), 4.8))
        w = 0.38
        for i, t in enumerate(PROXIES):
            vals = [summary[sc]["targets"][t].get(key) for sc in scs]
            xs = [j + (i - 0.5) * w for j in range(len(scs))]
            ax.bar(xs, [v if v is not None else 0 for v in vals], w, label=labels[t], color=colors[t])
            for x, v in zip(xs, vals):
                ax.text(x, (v or 0), "failed" if v is None else value_fmt.format(v), ha="center",
                        va="bottom", fontsize=7, rotation=90 if len(scs) > 6 else 0)
        if hline is not None:
            ax.axhline(hline, color="grey", lw=0.8, ls=":", label=f"= direct ({hline:g})")
        if refs is not None:
            refs(ax, scs, 2 * w)
        ax.set_xticks(range(len(scs)))
        ax.set_xticklabels(scs, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.margins(y=0.15)
        ax.set_title(title + title_suffix, fontsize=10)
        ax.legend(fontsize=7, loc=legend_loc)
        fig.tight_layout()
        save_png(fig, outdir / fname, 110)
        plt.close(fig)
        files.append(fname)

    def script_of(sc):
        return sc.split()[0]

    def ratio_refs(ax, scs, width):
        xs = list(range(len(scs)))
        conn = [summary[sc]["kind"] == "connect" for sc in scs]
        marks(ax, xs, [REFERENCE_CONNECT_RATIO if c else REFERENCE_TPS_RATIO.get(script_of(sc))
                       for sc, c in zip(scs, conn)], width,
              "reference: LokaDB ÷ direct, 32 clients " + " / ".join(f"{v:.2f}" for v in REFERENCE_TPS_RATIO.values())
              + f" ({' / '.join(REFERENCE_TPS_RATIO)}); a new connection per request {REFERENCE_CONNECT_RATIO:g}",
              REFERENCE_STYLE)
        marks(ax, xs, [GOAL_CONNECT_RATIO if c else GOAL_TPS_RATIO for c in conn], width,
              f"goal: ≥ {GOAL_TPS_RATIO:g} with 32 clients, ≥ {GOAL_CONNECT_RATIO:g} with a new connection per request",
              GOAL_STYLE)

    def added_refs(ax, scs, width):
        marks(ax, list(range(len(scs))), [REFERENCE_ADDED_P50_MS.get(script_of(sc)) for sc in scs], width,
              "reference: LokaDB's added p50 " + " / ".join(f"{v:g}" for v in REFERENCE_ADDED_P50_MS.values())
              + f" ms ({' / '.join(REFERENCE_ADDED_P50_MS)})", REFERENCE_STYLE)
        goal_line(ax, GOAL_ADDED_P50_MS, f"≤ {GOAL_ADDED_P50_MS:g} ms added")
        # The reference's 0.17–1.06 ms beside our 0.03–0.05: linear around 0, logarithmic above.
        ax.set_yscale("symlog", linthresh=0.1, linscale=2)
        ax.set_ylim(-0.1, 2)
        ticks = [-0.05, 0, 0.05, 0.1, 0.2, 0.5, 1, 2]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()

    bars({"throughput", "connect"}, "tps_ratio", "throughput-ratio.png", "throughput ÷ direct (median of R)",
         "Throughput through the proxy ÷ direct (32 clients; -C: 16 clients)", hline=1.0, refs=ratio_refs)
    bars({"latency"}, "added_p50_ms", "added-p50.png", "p50 added over direct, ms (symlog above 0.1)",
         "p50 latency added over direct, one client", refs=added_refs, value_fmt="{:.3f}", legend_loc="lower left")
    bars({"latency", "throughput", "connect"}, "cpu_us_per_txn", "cpu-per-statement.png",
         "proxy CPU per statement, µs (utime + stime)", "Proxy process CPU time per statement")
    if idle:
        fig, ax = plt.subplots(figsize=(6, 4))
        names = [labels[r["target"]] for r in idle]
        before = [r["rss_kib_idle_before"] / 1024 for r in idle]
        withc = [r["rss_kib_with_clients"] / 1024 for r in idle]
        xs = range(len(idle))
        ax.bar([x - 0.2 for x in xs], before, 0.4, label="idle", color="#8b949e")
        ax.bar([x + 0.2 for x in xs], withc, 0.4,
               label=f"with {idle[0]['requested_clients']} idle clients", color="#1f6feb")
        for x, v in zip(xs, withc):
            ax.text(x + 0.2, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
        for x, v in zip(xs, before):
            ax.text(x - 0.2, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names)
        ax.set_ylabel("RSS (MiB)")
        ax.set_title("Proxy RSS, idle and with idle clients" + title_suffix, fontsize=10)
        ax.legend()
        fig.tight_layout()
        save_png(fig, outdir / "rss.png", 110)
        plt.close(fig)
        files.append("rss.png")
    return files


def charts_data_section(meta: dict, summary: dict, idle: list[dict], outdir: Path, charts: list[str]) -> str:
    rel = os.path.relpath(outdir, HERE)
    q = f" — short runs, R={meta['reps']}; indicative only" if meta["mode"] == "quick" else ""
    L = [f"## Proxy core, {meta['mode']} mode{q}\n",
         f"Run `{meta['run_id']}` (folder `{rel}/`), commit `{meta['git']['commit'][:12]}`"
         f"{' (dirty tree)' if meta['git']['dirty'] else ''}, {meta['machine']['nproc']} cores, "
         f"{meta['data']['rows']:,} rows / {meta['data']['organizations']} organizations, R={meta['reps']}, medians. "
         f"Charts: {', '.join(f'`{rel}/{c}`' for c in charts)}.\n"]
    L.append("### throughput-ratio.png — throughput ÷ direct\n")
    L.append("| scenario | direct tps | LokaDB ÷ direct | PgBouncer ÷ direct |")
    L.append("|---|---:|---:|---:|")
    for sc, e in summary.items():
        if e["kind"] in ("throughput", "connect"):
            t = e["targets"]
            L.append(f"| {sc} | {fmt(t['direct']['tps'], 0)} | {fmt(t['lokadb']['tps_ratio'], 3)} | {fmt(t['pgbouncer']['tps_ratio'], 3)} |")
    L.append("\n### added-p50.png — p50 added over direct, one client (ms)\n")
    L.append("| scenario | direct p50 | LokaDB added | PgBouncer added |")
    L.append("|---|---:|---:|---:|")
    for sc, e in summary.items():
        if e["kind"] == "latency":
            t = e["targets"]
            L.append(f"| {sc} | {fmt(t['direct']['p50_ms'], 3)} | {fmt(t['lokadb']['added_p50_ms'], 3)} | {fmt(t['pgbouncer']['added_p50_ms'], 3)} |")
    L.append("\n### cpu-per-statement.png — proxy CPU µs per statement\n")
    L.append("| scenario | LokaDB | PgBouncer |")
    L.append("|---|---:|---:|")
    for sc, e in summary.items():
        t = e["targets"]
        L.append(f"| {sc} | {fmt(t['lokadb']['cpu_us_per_txn'], 1)} | {fmt(t['pgbouncer']['cpu_us_per_txn'], 1)} |")
    if idle:
        L.append("\n### rss.png — RSS (MiB)\n")
        L.append("| target | idle | with idle clients | clients | KiB per idle client |")
        L.append("|---|---:|---:|---:|---:|")
        for r in idle:
            L.append(f"| {r['target']} | {r['rss_kib_idle_before'] / 1024:.1f} | {r['rss_kib_with_clients'] / 1024:.1f} | {r['opened_clients']} | {fmt(r.get('rss_kib_per_idle_client'), 1)} |")
    L.append("")
    return "\n".join(L)


def update_charts_data(section: str, mode: str) -> None:
    write_charts_section(f"proxy-core {mode}", section)


def bin_dir_of(meta: dict, default) -> str:
    """Where a run's binaries were, as its raw numbers recorded them (the folder of its lokadb
    binary), not where they are as the summary is rendered again."""
    for b in (meta.get("binaries") or {}).values():
        if isinstance(b, dict) and b.get("path"):
            return str(Path(b["path"]).parent)
    return str(default)


def run_meta(script: str, run_id: str, started, mode, **extra) -> dict:
    """The `meta` of a harness's raw.json: what ran, where, with which binaries' commit."""
    meta = {"run_id": run_id, "mode": mode.name, "started_utc": started.isoformat(),
            "command": (f"/work/main/.venv/bin/python research/bench/{script} " + shlex.join(sys.argv[1:])).strip(),
            "env": {"LOKADB_BENCH_TARGET": os.environ.get("LOKADB_BENCH_TARGET")},
            "mode_settings": dict(vars(mode)), "machine": machine_info(), "git": git_info()}
    meta.update(extra)
    return meta


def summary_to_charts_data(name: str, summary_md: str) -> None:
    """A harness's summary.md as its charts-data.md section (its title one level down)."""
    write_charts_section(name, re.sub(r"^# ", "## ", summary_md, count=1))


def write_charts_section(name: str, section: str, path: Path | None = None) -> None:
    """Replaces what stands between `<!-- BEGIN name -->` and `<!-- END name -->` in
    research/bench/charts-data.md (or path) with section, or appends it if it is not there yet
    (every script's section goes through here)."""
    path = path or HERE / "charts-data.md"
    begin = f"<!-- BEGIN {name} -->"
    end = f"<!-- END {name} -->"
    block = f"{begin}\n{section}\n{end}\n"
    if path.exists():
        text = path.read_text()
    else:
        text = (
            "# Numbers behind the benchmark charts\n\n"
            "Written by `research/bench/run.py`: each section is replaced by the latest run of its "
            "mode; the charts are PNGs in the run's result folder, the raw numbers in its `raw.json`.\n\n"
        )
    if begin in text and end in text:
        pre, rest = text.split(begin, 1)
        _, post = rest.split(end, 1)
        text = pre + block + post.lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


# --------------------------------------------------------------------------------------
# Main


def parse_rtts(text: str, example: str) -> list[float]:
    """--rtts: round-trip times in ms separated by commas; exits with a message naming the
    problem (the example shows the form)."""
    try:
        rtts = [float(x) for x in text.split(",")]
    except ValueError:
        sys.exit(f"--rtts {text!r}: write round-trip times in ms separated by commas, e.g. {example}")
    if any(r < 0 for r in rtts):
        sys.exit(f"--rtts {text!r}: a round-trip time cannot be negative")
    return rtts


def run_rounds(ctx, raw: dict, outdir: Path, rtt_round) -> int:
    """One rtt_round(ctx, rtt) per RTT of ctx.mode, each appended to raw["rounds"] and saved
    in raw.json as it ends; 1 when a round had errors, else 0."""
    rc = 0
    for rtt in ctx.mode.rtts_ms:
        r = rtt_round(ctx, float(rtt))
        raw["rounds"].append(r)
        (outdir / "raw.json").write_text(json.dumps(raw, indent=1, default=str))
        if r["errors"]:
            rc = 1
    return rc


def result_dir(out: Path | None, tag: str, quick: bool):
    """(start time, run id, result folder): `out`, else results/<UTC ts><tag>[-quick] (made)."""
    started = dt.datetime.now(dt.timezone.utc)
    run_id = started.strftime("%Y%m%dT%H%M%SZ") + tag + ("-quick" if quick else "")
    outdir = out or (HERE / "results" / run_id)
    outdir.mkdir(parents=True, exist_ok=True)
    return started, run_id, outdir


def fatal(errors: list, e: Exception) -> int:
    """Records an exception that ended a run (in its except clause); returns the exit code."""
    errors.append(f"fatal: {e!r}\n{traceback.format_exc()}")
    log(f"FAILED: {e!r}")
    traceback.print_exc()
    return 1


def write_empty_summary(raw: dict, outdir: Path, title: str, what: str) -> str:
    """summary.md of a run in which no `what` completed: its title and errors; returns it."""
    md = f"# {title} — run {raw['meta']['run_id']}\n\nNo {what} completed.\n\n" + "\n".join(
        f"- {e[:2000]}" for e in raw["meta"]["errors"]) + "\n"
    (outdir / "summary.md").write_text(md)
    return md


def write_summary(outdir: Path, md: str, errors: list) -> str:
    """summary.md: `md`, then the run's errors if any; returns it."""
    if errors:
        md += "\n## Errors\n\n" + "\n".join(f"- {e[:500]}" for e in errors) + "\n"
    (outdir / "summary.md").write_text(md)
    return md


def write_outputs(raw: dict, s: dict, outdir: Path, charts_data: bool, summary_markdown, draw_charts,
                  update_charts_data) -> str:
    """summary.md, the charts (one that fails is reported, not fatal) and, if charts_data, the
    charts-data.md section of a run summarized as s, by the script's own functions; returns the
    markdown."""
    md = summary_markdown(raw, s)
    (outdir / "summary.md").write_text(md)
    charts = []
    try:
        charts = draw_charts(outdir, raw, s)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    if charts_data:
        update_charts_data(raw, s, outdir, charts)
    return md


def save_rendered(raw: dict, raw_json: Path, render, charts_data: bool) -> None:
    """render(raw, outdir, charts_data) into raw_json's folder, then the raw numbers (with the
    summary) compressed beside it as raw.json.gz (write_raw_gz); prints the markdown."""
    md = render(raw, raw_json.parent, charts_data)
    write_raw_gz(raw_json.parent, raw)
    print(md)


def guarded_run(ctx, raw: dict, outdir: Path, render, charts_data, body, binaries=(),
                before_cleanup=None, on_error=None) -> int:
    """A harness's run: body() (its exit code; None is 0) with an interrupt (130) or an
    exception (1, recorded in ctx.errors, then on_error(): what the script keeps of a failure)
    caught; then, whatever happened, signals ignored, before_cleanup() (what the script stops
    in its own order), every child and cluster stopped, `binaries` checked unchanged since
    raw["meta"]["binaries"] was taken (tunnel.binaries_at_end) and the outputs written
    (finish_run; charts_data a bool, or a function of the exit code). Returns the exit
    code."""
    t_start = time.time()
    rc = 0
    try:
        rc = body() or 0
    except KeyboardInterrupt as e:
        ctx.errors.append(f"interrupted: {e}")
        rc = 130
    except Exception as e:  # noqa: BLE001
        rc = fatal(ctx.errors, e)
        if on_error is not None:
            on_error()
    finally:
        ignore_signals()
        if before_cleanup is not None:
            before_cleanup()
        safe_cleanup()
        if binaries:
            # tunnel imports run: taken here, where every caller has it loaded already.
            from tunnel import binaries_at_end
            binaries_at_end(raw["meta"], ctx.errors, binaries)
        finish_run(raw, outdir, t_start, render, charts_data(rc) if callable(charts_data) else charts_data)
    return rc


def finish_run(raw: dict, outdir: Path, t_start: float, render, charts_data: bool) -> None:
    """The end of a run: its wall time and load average in raw["meta"], then the rendered
    outputs and raw.json (save_rendered)."""
    meta = raw["meta"]
    meta["wall_seconds"] = round(time.time() - t_start, 1)
    meta["loadavg_at_end"] = Path("/proc/loadavg").read_text().strip()
    save_rendered(raw, outdir / "raw.json", render, charts_data)
    log(f"results in {outdir}")


def rerender(raw_json: Path, render, charts_data: bool) -> int:
    """--render: render again from a run's raw.json or raw.json.gz, written back compressed
    (save_rendered)."""
    save_rendered(read_raw(raw_json), raw_json, render, charts_data)
    return 0


class Ctx:
    """A run's state: its mode, the setup commands and errors that go into raw.json, and what the
    script adds."""

    def __init__(self, mode):
        self.mode = mode
        self.commands = []
        self.errors = []


def machine_info() -> dict:
    def sh(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, shell=True).stdout.strip()
        except Exception:
            return ""

    return {
        "nproc": os.cpu_count(),
        "nproc_cmd": sh("nproc"),
        "uname": sh("uname -a"),
        "kernel": platform.release(),
        "cpu_model": sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2").strip(),
        "mem_total": sh("grep MemTotal /proc/meminfo"),
        "loadavg_at_start": Path("/proc/loadavg").read_text().strip(),
        "os": sh(". /etc/os-release && echo $PRETTY_NAME"),
        "python": sys.version.split()[0],
        "psycopg": psycopg.__version__,
    }


def git_info() -> dict:
    def g(*a):
        r = subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True)
        return r.stdout.strip()

    st = g("status", "--porcelain")
    return {"commit": g("rev-parse", "HEAD"), "dirty": bool(st), "status_porcelain": st.splitlines()[:50]}


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs, 50k rows, R=1 (< ~5 min)")
    ap.add_argument("--out", type=Path, help="result folder (default research/bench/results/<UTC ts>[-quick])")
    ap.add_argument("--reps", type=int, help="override the number of repetitions R")
    ap.add_argument("--no-charts-data", action="store_true", help="do not update research/bench/charts-data.md")
    ap.add_argument("--render", type=Path, help="only rebuild summary.md, the charts and charts-data.md from this "
                                                "raw.json or raw.json.gz (its summary as recorded)")
    args = ap.parse_args()
    if args.render:
        return rerender(args.render, render_proxy_core, not args.no_charts_data)

    if os.geteuid() != 0:
        sys.exit("run.py must run as root (it starts Postgres and PgBouncer as the user lokadb-pg)")
    for p in (PG_BIN / "postgres", PG_BIN / "pgbench", PGBOUNCER_BIN):
        if not Path(p).exists():
            sys.exit(f"missing {p}: run scripts/setup.sh first")
    if not LOKADB_BIN.exists():
        sys.exit(f"missing {LOKADB_BIN}: build the proxy first (cargo build --release)")

    mode = Mode(args.quick)
    if args.reps:
        mode.reps = args.reps
    started, run_id, outdir = result_dir(args.out, "", mode.quick)

    # 1000 idle clients need fds in this process, the proxy and PgBouncer (children inherit).
    raise_fd_limit()
    catch_signals()

    setup_commands: list[str] = []
    meta = {
        "run_id": run_id, "mode": mode.name, "started_utc": started.isoformat(),
        "reps": mode.reps, "organizations": ORGS,
        "durations": {"latency_s": mode.t_latency, "throughput_s": mode.t_throughput,
                      "connect_s": mode.t_connect, "warmup_s": mode.t_warmup},
        "machine": machine_info(), "git": git_info(), "lokadb_binary": binary_info(),
        "pgbouncer_version": subprocess.run([str(PGBOUNCER_BIN), "--version"], capture_output=True,
                                            text=True).stdout.splitlines()[0],
        "pgbench_version": subprocess.run([str(PG_BIN / "pgbench"), "--version"], capture_output=True,
                                          text=True).stdout.strip(),
        "LOKADB_CORES": os.environ.get("LOKADB_CORES", "(unset: all cores)"),
        "postgres_settings": {"synchronous_commit": "off", "fsync": "on (default)",
                              "max_connections": 1200, "shared_buffers": "256MB",
                              "password_encryption": "scram-sha-256"},
        "client_settings": {"sslmode": "disable", "auth": "SCRAM-SHA-256 as role app"},
        "setup_commands": setup_commands,
        "errors": [],
    }
    raw = {"meta": meta, "runs": [], "idle_clients": [], "summary": {}}
    t_start = time.time()
    world = None
    bench = None
    exit_code = 0
    try:
        log(f"mode={mode.name} R={mode.reps} rows={mode.rows} out={outdir}")
        world = World(mode, setup_commands)
        log("initdb + start PostgreSQL 18")
        world.start_postgres()
        meta["data"] = world.create_roles_and_data()
        meta["postgres"] = {"version": meta["data"].pop("postgres_version"), "port": world.pg_port}
        log(f"loaded {meta['data']['rows']} rows in {meta['data']['load_seconds']} s")
        log("start LokaDB proxy")
        world.start_proxy()
        log(f"LokaDB proxy on port {world.proxy_port} (pid {world.proxy.pid}), "
            f"RSS {world.proxy_rss_at_start} KiB")
        log("start PgBouncer")
        world.start_pgbouncer()
        log(f"PgBouncer on port {world.bouncer_port} (pid {world.bouncer.pid}), "
            f"RSS {world.bouncer_rss_at_start} KiB")
        meta["ports"] = {"postgres": world.pg_port, "lokadb": world.proxy_port, "pgbouncer": world.bouncer_port}

        bench = Bench(world, mode, world.tmp)
        meta["scripts"] = {k: v.format(rows=mode.rows, orgs=ORGS) for k, v in SCRIPTS.items()}

        log("warm-up")
        for t in TARGETS:
            for qm in QUERY_MODES:
                bench.pgbench(phase="warmup", kind="warmup", scenario=f"warmup read {qm}", script="read",
                                  qmode=qm, target=t, clients=32, threads=2,
                                  seconds=mode.t_warmup)

        for rep in range(mode.reps):
            order = rotated(rep)
            log(f"repetition {rep + 1}/{mode.reps}, target order {order}")
            for script in SCRIPTS:
                for qm in QUERY_MODES:
                    for kind, clients, threads, secs in (
                        ("latency", 1, 1, mode.t_latency),
                        ("throughput", 32, 2, mode.t_throughput),
                    ):
                        sc = f"{script} {qm} c{clients}"
                        for t in order:
                            bench.pgbench(phase="measure", kind=kind, scenario=sc, script=script, qmode=qm,
                                              target=t, clients=clients, threads=threads,
                                              seconds=secs, rep=rep)
            sc = "read simple, connect per txn"
            for t in order:
                bench.pgbench(phase="measure", kind="connect", scenario=sc, script="read", qmode="simple",
                                  target=t, clients=16, threads=2, seconds=mode.t_connect,
                                  connect_each=True, rep=rep)

        log(f"idle clients: {mode.idle_clients} through each proxy")
        # PgBouncer first: LokaDB's upstream pool keeps its cloud backends after the clients leave.
        for t in ["pgbouncer", "lokadb"]:
            try:
                res = idle_clients_test(world, t, mode.idle_clients)
            except Exception as e:
                res = {"target": t, "error": repr(e), "requested_clients": mode.idle_clients,
                       "opened_clients": 0, "rss_kib_idle_before": rss_kib(world.pid_of(t)),
                       "rss_kib_with_clients": -1, "rss_kib_after_close": -1,
                       "pg_backends_with_clients": None, "connect_seconds": None}
            res["rss_kib_at_start"] = world.proxy_rss_at_start if t == "lokadb" else world.bouncer_rss_at_start
            raw["idle_clients"].append(res)
            log(f"  {t}: RSS {res['rss_kib_idle_before']} KiB idle -> {res['rss_kib_with_clients']} KiB "
                f"with {res['opened_clients']} clients ({res.get('rss_kib_per_idle_client')} KiB/client), "
                f"{res.get('pg_backends_with_clients')} Postgres backends; {res.get('error', 'ok')}")
            if res.get("error"):
                meta["errors"].append(f"idle clients via {t}: {res['error']}")
        meta["alive_at_end"] = world.alive()
        meta["proxy_stderr_tail"] = world.proxy_stderr.read_text(errors="replace")[-4000:]
        bl = world.tmp / "pgbouncer.log"
        meta["pgbouncer_log_tail"] = bl.read_text(errors="replace")[-3000:] if bl.exists() else ""
    except KeyboardInterrupt as e:
        log(f"interrupted ({e}); cleaning up")
        meta["errors"].append(f"interrupted: {e}")
        exit_code = 130
    except Exception as e:
        log(f"FAILED: {e}")
        meta["errors"].append(f"fatal: {e}\n{traceback.format_exc()}")
        exit_code = 1
        if world is not None and getattr(world, "proxy_stderr", None) and world.proxy_stderr.exists():
            meta["proxy_stderr_tail"] = world.proxy_stderr.read_text(errors="replace")[-4000:]
    finally:
        ignore_signals()
        safe_cleanup()

    meta["duration_seconds"] = round(time.time() - t_start, 1)
    meta["finished_utc"] = dt.datetime.now(dt.timezone.utc).isoformat()
    if bench is not None:
        raw["runs"] = bench.runs
        meta["errors"].extend(bench.events)
        for r in bench.runs:
            if r["phase"] == "measure" and r.get("error"):
                meta["errors"].append(f"{r['scenario']} via {r['target']} (rep {r['rep']}): {r['error']}"
                                      + (f" — {r['first_error']}" if r.get("first_error") else ""))
    summary = summarize(raw["runs"], mode.reps) if raw["runs"] else {}
    raw["summary"] = summary
    (outdir / "raw.json").write_text(json.dumps(raw, indent=2, default=str))
    if summary and exit_code == 0:
        md = render_proxy_core(raw, outdir, not args.no_charts_data)
        print()
        print(md)
    log(f"results in {outdir} ({meta['duration_seconds']} s)")
    return exit_code


def render_proxy_core(raw: dict, outdir: Path, charts_data: bool) -> str:
    """run.py's outputs of a run's raw numbers: the charts, summary.md and, if charts_data, its
    charts-data.md section; returns the markdown."""
    meta, summary = raw["meta"], raw["summary"]
    charts = draw_charts(outdir, summary, raw["idle_clients"], f" ({meta['mode']} mode, run {meta['run_id']})")
    md = summary_markdown(meta, summary, raw["idle_clients"])
    (outdir / "summary.md").write_text(md)
    if charts_data:
        update_charts_data(charts_data_section(meta, summary, raw["idle_clients"], outdir, charts), meta["mode"])
    return md


if __name__ == "__main__":
    sys.exit(main())
