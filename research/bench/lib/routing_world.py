"""routing.py's world, also clients.py's, contention.py's, failures.py's and paths.py's: a cloud
cluster with the test schema and PAIRS documents per organization, organization 2's database
behind the relay and its agent, organization 2 moved once (`lokadb move-org 2 --profile fdw`),
organization 1 staying in the cloud (build_world); the proxy with the direct path's login
(start_proxy), the profile switch, and organization 2's statement log cut by markers (OrgLog,
analyse). CLOUD_PG, ORG_DB_SETTINGS and PAIRS are read by build_world as it runs: a script
may set them first."""

from __future__ import annotations

import json
import os
import re
import time

import psycopg

from .binaries import LOKADB_BIN
from .clusters import (
    APP_PASSWORD, CLOUD_PG, ORG, ORG_DB, ORG_PG, OTHER, SUPER_PASSWORD, TABLES, PgCluster, cluster_root,
    load_sql, lokadb, mask, org_database, schema_sql,
)
from .numbers import percentile
from .procs import log
from .relay import LineProc, stop_agents, tunnel_agent, tunnel_relay


AUTH_PASSWORD = "lokadb-auth-bench-secret"
PROFILES = ["fdw", "fdw+direct"]
PAIRS = 3000  # moves.load_sql: 2 x PAIRS documents (PAIRS per organization), one version each
MARK_APP = "lokadb-bench-mark"  # application_name of the benchmark's own connections to the org database
CLIENT_APP = "lokadb-bench-client"  # the client's (a direct connection copies it)
# The org cluster prefixes every log line with pid, application_name, user and database so the
# benchmark's own lines can be told apart and each statement attributed to its session.
ORG_LOG_PREFIX = "%n [%p] %a|%u|%d: "  # %n: Unix epoch with milliseconds
# Set on the org database after the move (new connections only). log_statement logs each simple
# query and each Execute; log_min_duration_statement = 0 adds a "duration: … parse NAME: …" line
# per Parse message, which log_statement does not log: postgres_fdw prepares its UPDATE … WHERE
# ctid = $1 with a Parse of its own (PQprepare), a round trip that has no statement line.
ORG_DB_SETTINGS = {"log_statement": "all", "log_min_duration_statement": "0"}
EXTRA_INDEXES = [
    "CREATE INDEX documents_org_id_idx ON documents (organization_id, id)",
    "CREATE INDEX document_versions_org_doc_idx ON document_versions (organization_id, document_id)",
]


READ_SQL = f"SELECT id, title FROM documents WHERE organization_id = {ORG} AND id = %s"
READ_SQL_1 = f"SELECT id, title FROM documents WHERE organization_id = {OTHER} AND id = %s"
UPDATE_SQL = f"UPDATE documents SET title = %s WHERE organization_id = {ORG} AND id = %s"
COUNT_SQL = f"SELECT count(*) FROM document_versions WHERE organization_id = {ORG} AND document_id = %s"
# An audit or version row after an update: the INSERT needs the cloud, so on fdw+direct the
# transaction that wrote directly moves there (docs/routing.md, "Transactions").
INSERT_SQL = f"INSERT INTO document_versions (organization_id, document_id, body) VALUES ({ORG}, %s, %s)"
# By primary key alone (an ORM's get): the proxy adds the key's organization from the key map.
KEY_SQL = "SELECT id, title FROM documents WHERE id = %s"


# --------------------------------------------------------------------------------------
# The organization's statement log, cut by markers


LINE_RE = re.compile(r"^(?P<ts>\d+\.\d+) \[(?P<pid>\d+)\] (?P<app>[^|]*)\|(?P<user>[^|]*)\|(?P<db>[^:]*): "
                     r"(?P<level>[A-Z]+):  (?P<msg>.*)$")
PARSE_RE = re.compile(r"^duration: [\d.]+ ms  parse (?P<name>\S+): (?P<sql>.*)$")


def parse_line(line: str):
    m = LINE_RE.match(line)
    return m.groupdict() if m else None


def statement_of(msg: str):
    """('statement'|'execute', SQL) for a log_statement line's message, else None."""
    if msg.startswith("statement: "):
        return "statement", msg[len("statement: "):]
    if msg.startswith("execute "):
        return "execute", msg.split(": ", 1)[1] if ": " in msg else msg
    return None


def keyword(sql: str) -> str:
    w = sql.strip().split()
    if not w:
        return "?"
    k = w[0].upper()
    if k == "START" and len(w) > 1:
        return "START TRANSACTION"
    return k


class OrgLog:
    """Reads organization 2's postgres.log from where it was and cuts it with markers: a marker is
    `SELECT 'bench-mark-<n>'` run on the org database by the benchmark's own session (its
    application_name is MARK_APP, its lines are never counted). Postgres writes a statement's line
    before running it, and every backend writes each message with one write() to the same O_APPEND
    file, so the lines between two markers are exactly what reached the database in between."""

    def __init__(self, org: PgCluster):
        self.path = org.dir / "postgres.log"
        self.pos = self.path.stat().st_size
        self.partial = ""
        self.pending: list[str] = []
        self.n = 0
        self.conn = org.conn(ORG_DB, application_name=MARK_APP)

    def _read(self):
        with open(self.path, "rb") as f:
            f.seek(self.pos)
            data = f.read()
        self.pos += len(data)
        text = self.partial + data.decode(errors="replace")
        lines = text.split("\n")
        self.partial = lines.pop()
        self.pending += lines

    def cut(self, timeout=15.0) -> list[str]:
        """The log lines since the previous cut (continuation lines included), up to the marker's
        statement line. The marker's own lines (its duration line comes after it) are dropped by
        analyse() as the benchmark's."""
        self.n += 1
        tag = f"bench-mark-{self.n}"
        self.conn.execute(f"SELECT '{tag}'")
        deadline = time.monotonic() + timeout
        while True:
            self._read()
            for i, line in enumerate(self.pending):
                p = parse_line(line)
                if p and p["app"] == MARK_APP and f"'{tag}'" in p["msg"]:
                    out = self.pending[:i]
                    self.pending = self.pending[i + 1:]
                    return out
            if time.monotonic() > deadline:
                raise RuntimeError(f"marker {tag} not found in {self.path}")
            time.sleep(0.005)

    def close(self):
        try:
            self.conn.close()
        except psycopg.Error:
            pass


def round_trips_from_times(events: list[dict], rtt_ms: float):
    """Requests that reached the org database together (a pipeline: e.g. a held BEGIN sent with the
    next statement, or Parse+Bind+Execute) are logged within a fraction of a millisecond; the next
    request of the same operation arrives at least one RTT later (the answer goes back, the next
    request comes). So at RTT > 0 the number of groups of log events separated by more than RTT/2
    is the number of round trips. Not defined at RTT 0."""
    if rtt_ms <= 0:
        return None
    ts = sorted(e["ts"] for e in events)
    if not ts:
        return 0
    groups = 1
    for a, b in zip(ts, ts[1:]):
        if (b - a) * 1e3 > rtt_ms / 2:
            groups += 1
    return groups


def analyse(lines: list[str], rtt_ms: float = 0.0, keep=400) -> dict:
    """Statements (log_statement lines) and Parse messages (duration lines) of every session but the
    benchmark's own, by source and kind; round trips from their timestamps (RTT > 0)."""
    stmts, parses, errors, other = [], [], [], 0
    last = None  # the statement a continuation line (no prefix: a multi-line SQL text) belongs to
    for line in lines:
        p = parse_line(line)
        if not p:
            if last is not None and line.strip():
                last["sql"] = (last["sql"] + " " + line.strip())[:400]
            continue
        last = None
        if p["app"] == MARK_APP:
            continue
        src = "direct" if p["app"] == CLIENT_APP else ("fdw" if p["app"] == "postgres_fdw" else p["app"] or "?")
        st = statement_of(p["msg"]) if p["level"] == "LOG" else None
        pm = PARSE_RE.match(p["msg"]) if p["level"] == "LOG" else None
        if st:
            kind, sql = st
            last = {"ts": float(p["ts"]), "pid": int(p["pid"]), "app": p["app"], "user": p["user"],
                    "source": src, "protocol": kind, "kw": keyword(sql), "sql": sql[:400]}
            stmts.append(last)
        elif pm:
            last = {"ts": float(p["ts"]), "pid": int(p["pid"]), "app": p["app"], "source": src,
                    "protocol": "parse", "name": pm.group("name"), "kw": "Parse " + keyword(pm.group("sql")),
                    "sql": pm.group("sql")[:400]}
            parses.append(last)
        elif p["level"] in ("ERROR", "FATAL", "PANIC", "WARNING"):
            errors.append(line[:500])
        else:
            other += 1  # duration lines of executes, DETAIL lines (parameters), connection lines
    by_source, by_kw = {}, {}
    for x in stmts:
        by_source[x["source"]] = by_source.get(x["source"], 0) + 1
        by_kw[x["kw"]] = by_kw.get(x["kw"], 0) + 1
    named = [x for x in parses if x["name"] != "<unnamed>"]
    by_parse = {}
    for x in parses:
        k = f"{x['source']}: {'named' if x['name'] != '<unnamed>' else 'unnamed'}"
        by_parse[k] = by_parse.get(k, 0) + 1
    events = sorted(stmts + parses, key=lambda x: (x["ts"], x["protocol"] != "parse"))
    groups = []  # at RTT > 0: the events of each round trip (see round_trips_from_times)
    if rtt_ms > 0:
        prev = None
        for x in events:
            if prev is None or (x["ts"] - prev) * 1e3 > rtt_ms / 2:
                groups.append([])
            groups[-1].append(("ᵈ" if x["source"] == "direct" else "") + x["kw"] if x["protocol"] != "parse"
                              else ("ᵈ" if x["source"] == "direct" else "") + x["kw"] + ("" if x["name"] != "<unnamed>" else " (unnamed)"))
            prev = x["ts"]
    return {"groups": groups[:60], "statements": len(stmts), "by_source": by_source, "by_keyword": by_kw,
            "parses": len(parses), "named_parses": len(named), "by_parse": by_parse,
            "round_trips_from_times": round_trips_from_times(stmts + parses, rtt_ms),
            "backends": len({x["pid"] for x in stmts}), "errors": errors[:20], "error_count": len(errors),
            "other_log_lines": other, "lines": events[:keep]}


# --------------------------------------------------------------------------------------
# The world


def build_world(ctx) -> dict:
    info = {"timings_s": {}}
    T = info["timings_s"]
    t0 = time.time()
    root = cluster_root(ctx.tmp / "world")
    ctx.org = org = PgCluster(root, "org", ctx.commands)
    org.create({**ORG_PG, "log_line_prefix": ORG_LOG_PREFIX})
    info["postgres_version"] = org_database(org)
    ctx.cloud = cloud = PgCluster(root, "cloud", ctx.commands)
    cloud.create(CLOUD_PG)
    with cloud.conn() as c:
        c.execute("CREATE DATABASE app")
        c.execute(f"CREATE ROLE lokadb_auth LOGIN SUPERUSER PASSWORD '{AUTH_PASSWORD}'")
    ctx.commands.append("(cloud) CREATE DATABASE app; CREATE ROLE lokadb_auth LOGIN SUPERUSER PASSWORD '***'")
    dsn = cloud.dsn()
    T["clusters"] = round(time.time() - t0, 1)
    # The relay and the agent (no link) for org add and the move.
    relay = tunnel_relay(ctx, ORG, "relay-setup")
    agent = tunnel_agent(ctx, relay.agents_port, org.addr())
    try:
        relay.wait_connected(1)
        t = time.time()
        lokadb(ctx, ["init"], dsn)
        sql = load_sql(PAIRS)
        with cloud.conn("app") as c:
            c.execute(schema_sql())
            for s in EXTRA_INDEXES:
                c.execute(s)
            c.execute(sql)
            c.execute("VACUUM ANALYZE documents")
            c.execute("VACUUM ANALYZE document_versions")
        ctx.commands.append("(cloud, database app) the SCHEMA of tests/tests/it/admin_enable.rs; "
                            + "; ".join(EXTRA_INDEXES) + "; " + " ".join(sql.split()))
        T["schema_load"] = round(time.time() - t, 1)
        t = time.time()
        for tbl in TABLES:
            lokadb(ctx, ["enable", tbl], dsn)
        lokadb(ctx, ["org", "add", ORG, "--via-relay", f"127.0.0.1:{ctx.relay_pg_port}", "--dbname", ORG_DB,
                     "--user", "app", "--password", APP_PASSWORD], dsn)
        T["enable_org_add"] = round(time.time() - t, 1)
        with cloud.conn("app") as c:
            info["rows"] = {tbl: dict(c.execute(
                f"SELECT organization_id::text, count(*) FROM {tbl} GROUP BY 1 ORDER BY 1").fetchall())
                for tbl in TABLES}
            ctx.ids1 = [r[0] for r in c.execute(
                f"SELECT id FROM documents WHERE organization_id = {OTHER} ORDER BY id").fetchall()]
        t = time.time()
        r = lokadb(ctx, ["move-org", ORG, "--profile", "fdw"], dsn, timeout=900)
        T["move_org"] = round(time.time() - t, 1)
        info["move_org_output"] = (r.stdout + r.stderr).strip().splitlines()[-30:]
        log(f"  lokadb move-org {ORG} --profile fdw: {T['move_org']} s")
    finally:
        stop_agents([agent])
        relay.stop()
    with cloud.conn("app") as c:
        cur = c.execute(f"SELECT * FROM lokadb.org WHERE id = '{ORG}'")
        info["lokadb_org"] = [dict(zip([d.name for d in cur.description], map(str, row))) for row in cur.fetchall()]
    with org.conn(ORG_DB, application_name=MARK_APP) as c:
        ctx.ids2 = [r[0] for r in c.execute(
            f"SELECT id FROM documents WHERE organization_id = {ORG} ORDER BY id").fetchall()]
        info["org_indexes"] = [r[0] for r in c.execute(
            "SELECT indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY indexname").fetchall()]
        info["org_rows"] = {tbl: c.execute(f"SELECT count(*) FROM {tbl}").fetchone()[0] for tbl in TABLES}
    # Every statement reaching the org database from now on is logged (new connections only:
    # none is open — the move's sessions ended, the relay and agent are stopped).
    with org.conn() as c:
        for k, v in ORG_DB_SETTINGS.items():
            c.execute(f"ALTER DATABASE {ORG_DB} SET {k} = '{v}'")
            ctx.commands.append(f"(org) ALTER DATABASE {ORG_DB} SET {k} = '{v}'")
    info["ids"] = {ORG: len(ctx.ids2), OTHER: len(ctx.ids1)}
    T["total"] = round(time.time() - t0, 1)
    log(f"  world ready in {T['total']} s: {info['org_rows']} rows of organization {ORG} in its database, "
        f"{len(ctx.ids1)} documents of organization {OTHER} in the cloud")
    return info


def start_proxy(ctx, tag: str, db_extra: dict | None = None, extra: dict | None = None) -> LineProc:
    """The proxy with the direct path's login, `db_extra` merged into its database's block and
    `extra` into the top level (clients.py)."""
    cfg = {"listen": "127.0.0.1:0",
           "databases": {"app": {"cloud": f"host=127.0.0.1 port={ctx.cloud.port} dbname=app",
                                 "auth_user": "lokadb_auth", "auth_password": AUTH_PASSWORD,
                                 "direct": {"user": "app", "password": APP_PASSWORD}, **(db_extra or {})}},
           **(extra or {})}
    path = ctx.tmp / f"proxy-{tag}.json"
    path.write_text(json.dumps(cfg, indent=1))
    ctx.proxy_config = json.loads(mask(json.dumps(cfg)).replace(AUTH_PASSWORD, "***"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOKADB_")}
    env["LOKADB_LOG"] = "warn"
    p = LineProc([LOKADB_BIN, "proxy", "--config", path], env, ctx.tmp / f"proxy-{tag}.stderr.log",
                 ctx.commands, "LOKADB_LOG=warn")
    _, m = p.wait_line(r"lokadb proxy listening on (\S+):(\d+)")
    p.port = int(m.group(2))
    return p


def client(ctx):
    return psycopg.connect(host="127.0.0.1", port=ctx.proxy.port, user="postgres", password=SUPER_PASSWORD,
                           dbname="app", sslmode="disable", autocommit=True, connect_timeout=30,
                           application_name=CLIENT_APP)


def set_profile(ctx, profile: str):
    with ctx.cloud.conn("app") as c:
        c.execute("UPDATE lokadb.org SET profile = %s WHERE id = %s", (profile, ORG))
        got = c.execute("SELECT profile FROM lokadb.org WHERE id = %s", (ORG,)).fetchone()[0]
    if got != profile:
        raise RuntimeError(f"profile is {got!r}, not {profile!r}")
    time.sleep(0.5)  # the proxy's metadata watcher learns it by NOTIFY


def relay_rtt_ms(ctx, n=10) -> float:
    """Median of `SELECT 1` straight through the relay's Postgres listener, link and agent."""
    with psycopg.connect(host="127.0.0.1", port=ctx.relay_pg_port, user="app", password=APP_PASSWORD,
                         dbname=f"{ORG}/{ORG_DB}", sslmode="disable", autocommit=True, connect_timeout=30,
                         application_name=MARK_APP) as c:
        c.execute("SELECT 1")
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            c.execute("SELECT 1", prepare=False)
            ts.append((time.perf_counter() - t) * 1e3)
    ts.sort()
    return round(percentile(ts, 0.5), 3)


# --------------------------------------------------------------------------------------
# Many clients' operations on it (clients.py, failures.py)


CLOUD_ORG = OTHER  # "1": stays in the cloud


def read_sql(org: str) -> str:
    return f"SELECT id, title FROM documents WHERE organization_id = {org} AND id = %s"


def update_sql(org: str) -> str:
    # document_versions.body has no constraint the cloud keeps: on fdw+direct the update goes
    # direct.
    return f"UPDATE document_versions SET body = %s WHERE organization_id = {org} AND id = %s"


def org_pairs(ctx) -> dict:
    """(document id, version id) pairs of the moved organization's rows (in its database) and of
    the cloud organization's, one pair per client (build_world made ctx.ids1/ids2)."""
    with ctx.org.conn(ORG_DB) as c:
        versions = [r[0] for r in c.execute(
            f"SELECT id FROM document_versions WHERE organization_id = {ORG} ORDER BY id").fetchall()]
    with ctx.cloud.conn("app") as c:
        versions1 = [r[0] for r in c.execute(
            f"SELECT id FROM document_versions WHERE organization_id = {CLOUD_ORG} ORDER BY id").fetchall()]
    return {ORG: list(zip(ctx.ids2, versions)), CLOUD_ORG: list(zip(ctx.ids1, versions1))}


def classify(e: BaseException) -> str:
    state = getattr(e, "sqlstate", None) or "-"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{state}: {first[:140]}"
