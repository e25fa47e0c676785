"""Throwaway PostgreSQL clusters run as the user lokadb-pg (PgCluster), the admin commands
(`lokadb ...` with LOKADB_CLOUD), and the world of tests/tests/it/admin_enable.rs's schema:
organization 2 (ORG, the one that moves) and 1 (OTHER, stays in the cloud), their bulk load, the
clusters' settings."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psycopg

from .binaries import LOKADB_BIN, PG_BIN, REPO
from .procs import CHILDREN, PG_USER, free_port, run_checked, stop_process

SUPER_PASSWORD = "postgres-bench-secret"
APP_PASSWORD = "app-bench-secret"
ORG = "2"  # the organization that moves
OTHER = "1"  # the one that stays in DEFAULT
ORG_DB = "orgdb"
BODY_BYTES = 1000  # document_versions.body of a bulk row (under the TOAST threshold: stored as is)
TABLES = ["documents", "document_versions"]


# Postgres settings. fsync stays on (default); synchronous_commit off as in run.py.
COMMON_PG = {"synchronous_commit": "off", "max_wal_size": "4GB", "min_wal_size": "80MB",
             "checkpoint_timeout": "15min"}
CLOUD_PG = {"max_connections": "100", "shared_buffers": "256MB", **COMMON_PG}
ORG_PG = {"max_connections": "100", "shared_buffers": "128MB", **COMMON_PG}


def mask(s: str) -> str:
    return s.replace(SUPER_PASSWORD, "***").replace(APP_PASSWORD, "***")


def schema_sql() -> str:
    """The test schema, read from tests/tests/it/admin_enable.rs (`SCHEMA`), so both stay one."""
    src = (REPO / "tests" / "tests" / "it" / "admin_enable.rs").read_text()
    m = re.search(r'pub\(crate\) const SCHEMA: &str = "(.*?)";\n', src, re.S)
    if not m or "\\" in m.group(1) or '"' in m.group(1):
        raise RuntimeError("could not read SCHEMA from tests/tests/it/admin_enable.rs")
    return m.group(1)


# --------------------------------------------------------------------------------------
# Clusters


class PgCluster:
    def __init__(self, root: Path, name: str, commands: list):
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        shutil.chown(self.dir, PG_USER, PG_USER)
        self.data = self.dir / "pgdata"
        self.name = name
        self.commands = commands
        self.proc = None
        self.port = None
        self.settings = {}

    def initdb(self):
        pwfile = self.dir / "pwfile"
        pwfile.write_text(SUPER_PASSWORD + "\n")
        shutil.chown(pwfile, PG_USER, PG_USER)
        os.chmod(pwfile, 0o600)
        cmd = [PG_BIN / "initdb", "-D", self.data, "-U", "postgres", f"--pwfile={pwfile}",
               "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8",
               "--locale=C.UTF-8", "--no-instructions"]
        self.commands.append(f"(as {PG_USER}) {shlex.join(map(str, cmd))}")
        run_checked([str(c) for c in cmd], user=PG_USER, group=PG_USER, extra_groups=[],
                    cwd=self.dir, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        pwfile.unlink()

    def create(self, settings: dict) -> "PgCluster":
        """initdb, then start with these settings."""
        self.initdb()
        self.start(settings)
        return self

    def clone_from(self, template: Path):
        cmd = ["cp", "-a", str(template), str(self.data)]
        self.commands.append(shlex.join(cmd))
        run_checked(cmd)

    def start(self, settings: dict):
        # A port in settings is kept (a restart at the same address: failures.py).
        self.port = int(settings.get("port") or free_port())
        s = {"listen_addresses": "127.0.0.1", "port": str(self.port),
             "unix_socket_directories": str(self.dir), "password_encryption": "scram-sha-256",
             "logging_collector": "off", **settings}
        self.settings = s
        cmd = [PG_BIN / "postgres", "-D", self.data]
        for k, v in s.items():
            cmd += ["-c", f"{k}={v}"]
        self.commands.append(f"(as {PG_USER}) {shlex.join(map(str, cmd))}")
        logf = open(self.dir / "postgres.log", "ab")
        self.proc = subprocess.Popen(
            [str(c) for c in cmd], stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            user=PG_USER, group=PG_USER, extra_groups=[], cwd=self.dir,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(self.dir)},
            start_new_session=True)
        self.proc._bench_stop_signal = signal.SIGINT
        CHILDREN.append(self.proc)
        wait_accepting(self.conn, self.proc, 120, lambda: f"Postgres {self.name} did not start:\n" + self.log_tail())

    def stop(self, wait=180.0):
        if self.proc is not None:
            stop_process(self.proc, signal.SIGINT, wait=wait)  # fast shutdown: a clean checkpoint
            if self.proc in CHILDREN:
                CHILDREN.remove(self.proc)
            self.proc = None

    def log_tail(self, n=3000) -> str:
        p = self.dir / "postgres.log"
        return p.read_text(errors="replace")[-n:] if p.exists() else ""

    def conn(self, dbname="postgres", user="postgres", password=SUPER_PASSWORD, autocommit=True, **kw):
        return psycopg.connect(host="127.0.0.1", port=self.port, user=user, password=password,
                               dbname=dbname, sslmode="disable", autocommit=autocommit,
                               connect_timeout=30, **kw)

    def dsn(self, dbname="app", port=None) -> str:
        return (f"host=127.0.0.1 port={port or self.port} user=postgres password={SUPER_PASSWORD} "
                f"dbname={dbname} sslmode=disable")

    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def one(self, sql: str, dbname="app"):
        with self.conn(dbname) as c:
            return c.execute(sql).fetchone()[0]


def wait_accepting(connect, proc, timeout: float, failure) -> None:
    """Waits until connect() gives a connection to the Postgres that proc started; raises
    RuntimeError(failure()) if proc exits or timeout seconds pass first."""
    deadline = time.time() + timeout
    while True:
        try:
            with connect():
                return
        except psycopg.OperationalError:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(failure())
            time.sleep(0.2)


def cluster_root(d: Path) -> Path:
    """d, made and given to the Postgres user: the folder of a run's clusters."""
    d.mkdir()
    shutil.chown(d, PG_USER, PG_USER)
    return d


def org_database(org: PgCluster) -> str:
    """The role app and the database ORG_DB it owns, in an organization's cluster; its version()."""
    with org.conn() as c:
        c.execute(f"CREATE ROLE app LOGIN PASSWORD '{APP_PASSWORD}'")
        c.execute(f"CREATE DATABASE {ORG_DB} OWNER app")
        return c.execute("SELECT version()").fetchone()[0]


def lokadb(ctx, args: list, dsn: str, timeout=3600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOKADB_")}
    # Plain TCP to the relay: the PostgreSQL 18 wheel's libpq has no TLS.
    env.update({"LOKADB_CLOUD": dsn, "LOKADB_LOG": "warn", "LOKADB_RELAY_SSLMODE": "disable"})
    cmd = [str(LOKADB_BIN), *args]
    ctx.commands.append(mask(f"LOKADB_CLOUD='{dsn}' " + shlex.join(cmd)))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{mask(shlex.join(cmd))} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


# --------------------------------------------------------------------------------------
# The bulk load


def load_sql(pairs: int, factor: int = 1) -> str:
    # Triggers off for the bulk load (session_replication_role = replica): the rows are
    # consistent by construction, the FK checks and the audit trigger would only slow it.
    # Organization 2 gets `pairs`, organization 1 `factor` times as many, interleaved.
    return f"""
SET session_replication_role = replica;
INSERT INTO documents (organization_id, project_id, title)
  SELECT o, 10 * o, 'bulk ' || g
    FROM (SELECT g, CASE WHEN g % {factor + 1} = 0 THEN 2 ELSE 1 END AS o
            FROM generate_series(1, {(factor + 1) * pairs}) g) s;
INSERT INTO document_versions (organization_id, document_id, body)
  SELECT organization_id, id, left(repeat(md5(id::text), {BODY_BYTES // 32 + 1}), {BODY_BYTES})
    FROM documents WHERE title LIKE 'bulk %';
SET session_replication_role = origin;
"""
