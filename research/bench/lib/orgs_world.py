"""orgs.py's worlds, also statement_org.py's, cloud_tls.py's and metrics.py's (side_by_side): one
cloud cluster holding one LokaDB world per number of organizations N (database app_<N>, the
organizations built in SQL as move-org + move-back leave them), one proxy serving them all, and
pgbench through it or straight at the cloud with the proxy's and the cloud's CPU per
statement."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import tempfile
import time
from pathlib import Path

import psycopg

from .binaries import LOKADB_BIN, PG_BIN
from .clusters import APP_PASSWORD, ORG_DB, PgCluster, cluster_root, lokadb, mask
from .pgbench import latency_summary, parse_pgbench, pgbench_errors, txn_entries
from .procs import CLK_TCK, cpu_ticks, delta, loadavg, log, run_captured, sched_ns, tree_ticks
from .relay import LineProc


AUTH_PASSWORD = "lokadb-auth-bench-secret"
TOTAL_ROWS = 60_000  # documents of the N organizations together, at every N (ids 1..TOTAL_ROWS)
PLAIN_ORGS = 20  # plain cloud organizations (no lokadb.org row, rows in DEFAULT) ...
PLAIN_BASE = 1_000_000  # ... with ids PLAIN_BASE + 1 ..
PLAIN_ROWS = 4_000  # ... and these rows together (ids TOTAL_ROWS + 1 ..)
BATCH = 100  # organizations per DDL transaction
FAKE_RELAY_PORT = 9  # lokadb.org.relay_port and the servers' port: nothing listens, nothing dials it
ORG_DBNAME = ORG_DB  # "orgdb": lokadb.org.dbname of the synthetic organizations (as org add records it)
CLOUD_PG = {"max_connections": "250", "shared_buffers": "256MB", "synchronous_commit": "off",
            "max_wal_size": "4GB", "checkpoint_timeout": "15min",
            # Off: autovacuum's work on N partitions after the write runs landed in later runs
            # (the cloud's CPU is the postmaster's whole tree). Each world is VACUUM ANALYZEd.
            "autovacuum": "off"}
# The default (64) is too small for thousands of partitions: the plan cache builds a generic
# plan of a prepared statement at its 6th execution, which locks every partition and index
# (about 4 per organization); 32 backends doing it at once at 1000 organizations ran out of
# the shared lock table ("out of shared memory", direct and through the proxy alike; run
# results/20261204T082851Z-orgs-quick). 2048 x ~270 backends holds 32 x 3000 x 5.
MAX_LOCKS = 2048
SCRIPTS = ["read", "update", "insert", "route"]
QUERY_MODES = ["simple", "extended", "prepared"]
CLIENTS, THREADS = 32, 2
ROUTE_RATE = 6000  # the route script runs at this fixed rate (pgbench -R): same load at every N
PROXY_LOG = "warn,lokadb::route::watch=info"  # the watcher's "metadata loaded … organizations=N"


TABLE_DDL = """CREATE TABLE documents (
    id bigserial PRIMARY KEY,
    organization_id int NOT NULL,
    title text,
    body text,
    updated_at timestamptz DEFAULT now())"""
INDEX_DDL = "CREATE INDEX documents_org_id ON documents (organization_id, id)"

SCRIPT_TEXT = {
    "read": ("\\set i random(1, {total})\n"
             "\\set org 1 + (:i - 1) % {n}\n"
             "SELECT id, organization_id, title, updated_at FROM documents "
             "WHERE organization_id = :org AND id = :i;\n"),
    "update": ("\\set i random(1, {total})\n"
               "\\set org 1 + (:i - 1) % {n}\n"
               "UPDATE documents SET title = 'updated title', updated_at = now() "
               "WHERE organization_id = :org AND id = :i;\n"),
    "insert": ("\\set org random(1, {n})\n"
               "INSERT INTO documents (organization_id, title, body) "
               "VALUES (:org, 'bench title', 'bench body of a new document');\n"),
    # The proxy's whole path (analysis, placement by the organization, set_config) while the
    # cloud's work does not depend on N: a constant-false condition prunes every partition at
    # planning, none is opened. A change with N here is the proxy's.
    "route": ("\\set i random(1, {total})\n"
              "\\set org 1 + (:i - 1) % {n}\n"
              "SELECT id, organization_id, title, updated_at FROM documents "
              "WHERE organization_id = :org AND id = :i AND false;\n"),
}
# Warms the proxy's pooled cloud backends (pgbench -c 32 -t 1 through the proxy: 32 sessions at
# once, so 32 distinct backends): each plans a statement over every partition, which opens them
# all (relation, indexes, triggers, statistics) in that backend; one at a time (the advisory
# lock), so the lock table holds one backend's partitions at once.
WARM_SCRIPT = ("BEGIN;\n"
               "SELECT pg_advisory_xact_lock(4242);\n"
               "SELECT count(*) FROM documents WHERE id < 0;\n"
               "COMMIT;\n")


class Mode:
    def __init__(self, quick: bool):
        self.quick = quick
        self.name = "quick" if quick else "full"
        self.orgs = [1, 1000] if quick else [1, 100, 1000, 3000]
        self.seconds = 1 if quick else 4  # each pgbench run
        self.reps = 1 if quick else 2
        self.max_locks = MAX_LOCKS
        self.first_n = 25 if quick else 50  # connections per world and target
        self.query_modes = list(QUERY_MODES)
        self.scripts = list(SCRIPTS)
        self.fidelity = True
        # "folded": the N organizations as move-back leaves a small one (back in DEFAULT);
        # "partitioned": as `move-back --fold-max-rows 0` leaves them (a partition each).
        self.layout = "folded"
        # The proxy's `statement_org` (on by default): off measures the worlds without its
        # request per change of organization (statement_org.py measures it side by side).
        self.statement_org = True


def db_of(n: int) -> str:
    return f"app_{n}"


def q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def lit(v) -> str:
    return "'" + str(v).replace("'", "''") + "'"


# --------------------------------------------------------------------------------------
# What move-org + move-back leave, built in SQL (proxy/src/admin/moves/{layout,split}.rs)


def default_indexes(c, table="documents") -> list[dict]:
    """The DEFAULT partition's indexes, as layout::tables reads them (valid, not partial, no
    expressions), in the form cloud_part_ddl rebuilds them on the organization's partition."""
    rows = c.execute(
        """SELECT i.indisprimary, i.indisunique, pg_get_indexdef(i.indexrelid),
                  array(SELECT a.attname::text FROM unnest(i.indkey) WITH ORDINALITY k(att, n)
                        JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.att ORDER BY k.n)
           FROM pg_index i
           WHERE i.indrelid = (SELECT format('%%I.%%I', schema_name, default_partition)::regclass
                               FROM lokadb.tables WHERE table_name = %s)
             AND i.indisvalid AND i.indpred IS NULL AND i.indexprs IS NULL
           ORDER BY i.indexrelid""", (table,)).fetchall()
    out = []
    for primary, unique, idef, cols in rows:
        using = idef[idef.index(" USING ") + 1:]
        out.append({"primary": primary, "unique": unique, "columns": cols, "using": using})
    return out


def org_sql(org: str, indexes: list[dict], relay_port: int = FAKE_RELAY_PORT, partitioned: bool = True) -> dict:
    """The statements for one organization, table `public.documents`, organization column
    `organization_id`: when `partitioned`, split.rs's first transaction (own table, cloud
    partition with its CHECK and indexes, attached to the own table) and its attach to the
    parent; always what `org add` leaves (server, user mapping, lokadb.org row; state defaults
    to 'cloud'). Folded (not partitioned), that is all a move out and back leaves."""
    key = org  # layout::org_key: the id itself (ASCII alphanumeric, <= 20 bytes)
    assert key.isascii() and key.isalnum() and len(key) <= 20, org
    parent = '"public"."documents"'
    own = f'"public"."documents__lokadb_{key}"'
    part = f'"public"."documents__lokadb_{key}_c"'
    col = '"organization_id"'
    first = [
        f"CREATE TABLE {own} (LIKE {parent} INCLUDING DEFAULTS INCLUDING GENERATED INCLUDING CONSTRAINTS) "
        f"PARTITION BY LIST ({col})",
        f"CREATE TABLE {part} (LIKE {parent} INCLUDING DEFAULTS INCLUDING GENERATED INCLUDING CONSTRAINTS "
        f"INCLUDING STORAGE, CONSTRAINT lokadb_org CHECK ({col} IS NOT NULL AND {col} = {lit(org)}))",
    ]
    for i in indexes:
        if i["primary"]:
            first.append(f"ALTER TABLE {part} ADD PRIMARY KEY ({', '.join(q(c) for c in i['columns'])})")
        else:
            first.append(f"CREATE {'UNIQUE ' if i['unique'] else ''}INDEX ON {part} {i['using']}")
    first.append(f"ALTER TABLE {own} ATTACH PARTITION {part} FOR VALUES IN ({lit(org)})")
    attach = [f"ALTER TABLE {parent} ATTACH PARTITION {own} FOR VALUES IN ({lit(org)})"]
    if not partitioned:
        first, attach = [], []
    server = f"lokadb_org_{org}"
    registry = [
        f"CREATE SERVER {q(server)} FOREIGN DATA WRAPPER postgres_fdw OPTIONS (host '127.0.0.1', "
        f"port {lit(relay_port)}, dbname {lit(org + '/' + ORG_DBNAME)}, fetch_size '1000', sslmode 'disable')",
        f"CREATE USER MAPPING FOR PUBLIC SERVER {q(server)} OPTIONS (user 'app', password {lit(APP_PASSWORD)})",
    ]
    row = (org, None, "fdw", server, "127.0.0.1", relay_port, ORG_DBNAME, "synthetic (lokadb-bench orgs.py)")
    return {"first": first, "attach": attach, "registry": registry, "row": row}


def create_orgs(c, orgs: list[str], indexes: list[dict], commands: list, relay_port=FAKE_RELAY_PORT,
                pg_version: str | None = None, batch_seconds: list | None = None, partitioned: bool = True) -> float:
    """Creates the organizations in transactions of BATCH. Returns the seconds it took."""
    t0 = time.time()
    c.execute("CREATE EXTENSION IF NOT EXISTS postgres_fdw")
    example = org_sql(orgs[0], indexes, relay_port, partitioned)
    commands.append(mask(f"(cloud, per organization, {BATCH} per transaction; e.g. {orgs[0]}) "
                         + "; ".join(example["first"] + example["attach"] + example["registry"])
                         + "; INSERT INTO lokadb.org (id, name, profile, server, relay_host, relay_port, dbname, "
                           f"pg_version) VALUES {example['row']}"))
    for k in range(0, len(orgs), BATCH):
        tb = time.time()
        chunk = orgs[k:k + BATCH]
        parts = [org_sql(o, indexes, relay_port, partitioned) for o in chunk]
        with c.transaction():
            c.execute(";\n".join(s for p in parts for s in p["first"] + p["attach"] + p["registry"]))
            rows = [p["row"] if pg_version is None else (*p["row"][:7], pg_version) for p in parts]
            with c.cursor() as cur:
                cur.executemany(
                    "INSERT INTO lokadb.org (id, name, profile, server, relay_host, relay_port, dbname, pg_version) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s)", rows)
        if batch_seconds is not None:
            batch_seconds.append(round(time.time() - tb, 3))
    return round(time.time() - t0, 2)


def load_rows(c, n: int) -> None:
    """TOTAL_ROWS documents over organizations 1..n (id i -> organization 1 + (i-1) % n), then
    PLAIN_ROWS of plain cloud organizations (DEFAULT), through the parent: the LokaDB triggers
    (the pause gate, the key map) run for every row, as for an application's inserts."""
    c.execute(f"""INSERT INTO documents (id, organization_id, title, body)
                  SELECT i, 1 + (i - 1) % {n}, 'document ' || i, repeat(md5(i::text), 6)
                  FROM generate_series(1, {TOTAL_ROWS}) AS i""")
    c.execute(f"""INSERT INTO documents (id, organization_id, title, body)
                  SELECT i, {PLAIN_BASE} + 1 + i % {PLAIN_ORGS}, 'document ' || i, repeat(md5(i::text), 6)
                  FROM generate_series({TOTAL_ROWS + 1}, {TOTAL_ROWS + PLAIN_ROWS}) AS i""")
    c.execute("SELECT setval('documents_id_seq', (SELECT max(id) FROM documents))")


def load_sql_text(n: int) -> str:
    return (f"INSERT INTO documents (id, organization_id, title, body) SELECT i, 1 + (i - 1) % {n}, "
            f"'document ' || i, repeat(md5(i::text), 6) FROM generate_series(1, {TOTAL_ROWS}) AS i; "
            f"INSERT INTO documents (id, organization_id, title, body) SELECT i, {PLAIN_BASE} + 1 + i % "
            f"{PLAIN_ORGS}, 'document ' || i, repeat(md5(i::text), 6) FROM generate_series({TOTAL_ROWS + 1}, "
            f"{TOTAL_ROWS + PLAIN_ROWS}) AS i; SELECT setval('documents_id_seq', (SELECT max(id) FROM documents)); "
            "VACUUM ANALYZE documents")


def app_conn(port: int, dbname: str, **kw):
    return psycopg.connect(host="127.0.0.1", port=port, user="app", password=APP_PASSWORD, dbname=dbname,
                           sslmode="disable", autocommit=True, connect_timeout=30, **kw)


def world_counts(c, n: int) -> dict:
    r = {}
    r["lokadb_org_rows"] = c.execute("SELECT count(*) FROM lokadb.org").fetchone()[0]
    r["lokadb_org_states"] = dict(c.execute("SELECT state, count(*) FROM lokadb.org GROUP BY 1").fetchall())
    r["partitions_of_documents"] = c.execute(
        "SELECT count(*) FROM pg_inherits WHERE inhparent = 'documents'::regclass").fetchone()[0]
    r["partitions_in_tree"] = c.execute(
        "SELECT count(*) FROM pg_partition_tree('documents') WHERE relid <> 'documents'::regclass").fetchone()[0]
    r["rows_total"] = c.execute("SELECT count(*) FROM documents").fetchone()[0]
    r["rows_in_default"] = c.execute("SELECT count(*) FROM ONLY documents__lokadb_default").fetchone()[0]
    r["org_rows_in_default"] = c.execute(
        f"SELECT count(*) FROM ONLY documents__lokadb_default WHERE organization_id <= {n}").fetchone()[0]
    mn, mx = c.execute(f"""SELECT min(k), max(k) FROM (SELECT count(*) k FROM documents
                           WHERE organization_id <= {n} GROUP BY organization_id) s""").fetchone()
    r["rows_per_org_min_max"] = [mn, mx]
    r["orgs_with_rows"] = c.execute(
        f"SELECT count(DISTINCT organization_id) FROM documents WHERE organization_id <= {n}").fetchone()[0]
    r["key_map_rows"] = c.execute("SELECT count(*) FROM lokadb.km_documents_id").fetchone()[0]
    r["db_size_mb"] = round(c.execute("SELECT pg_database_size(current_database())").fetchone()[0] / 1e6, 1)
    r["pg_class_rows"] = c.execute("SELECT count(*) FROM pg_class").fetchone()[0]
    return r


def partitioned(ctx) -> bool:
    """Whether the worlds give each organization a partition (another script's Mode may not
    say: then they do, as before the fold existed)."""
    return getattr(ctx.mode, "layout", "partitioned") == "partitioned"


def build_world(ctx, n: int) -> dict:
    db = db_of(n)
    info = {"database": db, "orgs": n, "timings_s": {}}
    T = info["timings_s"]
    t0 = time.time()
    with ctx.cloud.conn() as c:
        c.execute(f"CREATE DATABASE {db} OWNER app")
    with app_conn(ctx.cloud.port, db) as c:
        c.execute(TABLE_DDL)
        c.execute(INDEX_DDL)
    ctx.commands.append(f"(cloud) CREATE DATABASE {db} OWNER app; (as app) {' '.join(TABLE_DDL.split())}; {INDEX_DDL}")
    dsn = ctx.cloud.dsn(db)
    lokadb(ctx, ["init"], dsn)
    lokadb(ctx, ["enable", "documents"], dsn)
    T["init_enable"] = round(time.time() - t0, 2)
    with ctx.cloud.conn(db) as c:
        indexes = default_indexes(c)
        info["default_indexes"] = indexes
        info["create_orgs_batch_seconds"] = batches = []
        T["create_orgs"] = create_orgs(c, [str(i) for i in range(1, n + 1)], indexes, ctx.commands,
                                       batch_seconds=batches, partitioned=partitioned(ctx))
    t = time.time()
    with app_conn(ctx.cloud.port, db) as c:  # the application's role, through the parent
        load_rows(c, n)
    with ctx.cloud.conn(db) as c:
        c.execute("VACUUM ANALYZE documents")
        c.execute("CHECKPOINT")
    ctx.commands.append(f"(cloud, {db}, as app then postgres) " + load_sql_text(n))
    T["load_analyze"] = round(time.time() - t, 2)
    with ctx.cloud.conn(db) as c:
        info["counts"] = world_counts(c, n)
    T["total"] = round(time.time() - t0, 2)
    cnt = info["counts"]
    problems = []
    if cnt["lokadb_org_rows"] != n or cnt["lokadb_org_states"] != {"cloud": n}:
        problems.append(f"lokadb.org has {cnt['lokadb_org_rows']} rows, states {cnt['lokadb_org_states']}")
    want_parts, want_in_default = (n + 1, 0) if partitioned(ctx) else (1, TOTAL_ROWS)
    if cnt["partitions_of_documents"] != want_parts:
        problems.append(f"documents has {cnt['partitions_of_documents']} partitions, not {want_parts}")
    if cnt["org_rows_in_default"] != want_in_default:
        problems.append(f"{cnt['org_rows_in_default']} rows of the N organizations are in DEFAULT, not {want_in_default}")
    if cnt["orgs_with_rows"] != n:
        problems.append(f"only {cnt['orgs_with_rows']} of {n} organizations have rows")
    if cnt["key_map_rows"] != cnt["rows_total"]:
        problems.append(f"key map has {cnt['key_map_rows']} keys for {cnt['rows_total']} rows")
    info["problems"] = problems
    log(f"  world {db}: {n} organizations in {T['create_orgs']} s, rows loaded + analyzed in {T['load_analyze']} s, "
        f"{cnt['partitions_in_tree']} relations in the partition tree, {cnt['rows_per_org_min_max']} rows per "
        f"organization; {'; '.join(problems) or 'checks ok'}")
    if problems:
        ctx.errors.append(f"world {db}: " + "; ".join(problems))
    return info


def start_cloud(ctx) -> str:
    """The cloud cluster (ctx.cloud) with the roles app and lokadb_auth; its version."""
    root = cluster_root(ctx.tmp / "clusters")
    ctx.cloud = PgCluster(root, "cloud", ctx.commands)
    ctx.cloud.create({**CLOUD_PG, "max_locks_per_transaction": str(ctx.mode.max_locks)})
    with ctx.cloud.conn() as c:
        c.execute("SET password_encryption = 'scram-sha-256'")
        c.execute(f"CREATE ROLE app LOGIN PASSWORD '{APP_PASSWORD}'")
        c.execute(f"CREATE ROLE lokadb_auth LOGIN SUPERUSER PASSWORD '{AUTH_PASSWORD}'")
        c.execute("GRANT pg_read_all_stats TO app")  # the planner probe reads its backend's memory
        version = c.execute("SELECT version()").fetchone()[0]
    ctx.commands.append("(cloud) CREATE ROLE app LOGIN PASSWORD '***'; "
                        "CREATE ROLE lokadb_auth LOGIN SUPERUSER PASSWORD '***'; GRANT pg_read_all_stats TO app")
    return version


# --------------------------------------------------------------------------------------
# The proxy


def start_proxy(ctx, db_extra: dict | None = None, name: str = "lokadb", cloud_options: str = "",
                top_extra: dict | None = None) -> LineProc:
    """A proxy serving every world; `db_extra` is added to each `databases` entry,
    `cloud_options` to each `cloud` connection string and `top_extra` to the top level
    (another script's variant: statement_org.py, cloud_tls.py, metrics.py)."""
    dbs = {db_of(n): {"cloud": f"host=127.0.0.1 port={ctx.cloud.port} dbname={db_of(n)} {cloud_options}".strip(),
                      "auth_user": "lokadb_auth", "auth_password": AUTH_PASSWORD, **(db_extra or {})}
           for n in ctx.mode.orgs}
    cfg = {"listen": "127.0.0.1:0", "databases": dbs, **(top_extra or {})}
    path = ctx.tmp / f"{name}.json"
    path.write_text(json.dumps(cfg, indent=1))
    ctx.proxy_config = json.loads(json.dumps(cfg).replace(AUTH_PASSWORD, "***"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOKADB_")}
    env["LOKADB_LOG"] = PROXY_LOG
    p = LineProc([LOKADB_BIN, "proxy", "--config", path], env, ctx.tmp / f"{name}.stderr.log", ctx.commands,
                 f"LOKADB_LOG={PROXY_LOG}")
    _, m = p.wait_line(r"lokadb proxy listening on (\S+):(\d+)")
    p.port = int(m.group(2))
    p.pid = p.proc.pid
    return p


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def metadata_lines(ctx) -> list[dict]:
    out = []
    text = ANSI.sub("", ctx.proxy.stderr_path.read_text(errors="replace"))
    for line in text.splitlines():
        if "metadata loaded" not in line:
            continue
        d = {"line": line.strip()[:400]}
        for k in ("database", "generation", "tables", "organizations", "load_ms"):
            m = re.search(rf"\b{k}=\"?([\w.]+)\"?", line)
            if m:
                d[k] = m.group(1)
        out.append(d)
    return out


def wait_metadata(ctx, timeout=60.0) -> dict:
    """Until the watcher of every world has loaded its organizations."""
    want = {db_of(n): n for n in ctx.mode.orgs}
    deadline = time.time() + timeout
    while True:
        seen = {}
        for d in metadata_lines(ctx):
            if d.get("database") in want and d.get("organizations") is not None:
                seen[d["database"]] = d
        if all(db in seen and int(seen[db]["organizations"]) == n for db, n in want.items()):
            return seen
        if time.time() > deadline or ctx.proxy.proc.poll() is not None:
            raise RuntimeError(f"the proxy did not load every world's metadata: {seen}\n"
                               + ctx.proxy.stderr_path.read_text(errors="replace")[-3000:])
        time.sleep(0.2)


def port_of(ctx, target: str) -> int:
    return ctx.cloud.port if target == "direct" else ctx.proxy.port


# --------------------------------------------------------------------------------------
# pgbench


def script_file(ctx, script: str, n: int) -> Path:
    p = ctx.tmp / f"{script}-{n}.sql"
    if not p.exists():
        p.write_text(WARM_SCRIPT if script == "warm" else SCRIPT_TEXT[script].format(total=TOTAL_ROWS, n=n))
    return p


def txn_log(prefix: Path) -> dict:
    """Latencies and completion times from pgbench's per-transaction logs (-l): p50, p99, and
    the throughput of the run's second half (completions after its midpoint), which shows a
    warming backend (direct runs start with new backends)."""
    lat, done, failed = txn_entries(prefix)
    out = {**latency_summary(lat, failed), "tps_first_half": None, "tps_second_half": None}
    if len(done) > 10:
        t0, t1 = min(done), max(done)
        mid = (t0 + t1) / 2
        if t1 - mid > 0.2:
            out["tps_first_half"] = round(sum(1 for t in done if t <= mid) / (mid - t0), 1)
            out["tps_second_half"] = round(sum(1 for t in done if t > mid) / (t1 - mid), 1)
    return out


def pgbench(ctx, *, phase, script, qmode, n, target, seconds=None, transactions=None, rep=None) -> dict:
    if ctx.proxy.proc.poll() is not None:
        raise RuntimeError(f"the proxy died (exit {ctx.proxy.proc.returncode}):\n"
                           + ctx.proxy.stderr_path.read_text(errors="replace")[-2000:])
    logdir = Path(tempfile.mkdtemp(prefix="pgblog-", dir=ctx.tmp))
    prefix = logdir / "txn"
    length = ["-t", str(transactions)] if transactions else ["-T", str(seconds)]
    if script == "route":  # the same statements per second at every N: the proxy's CPU per statement compares
        length += ["-R", str(ROUTE_RATE)]
    cmd = [str(PG_BIN / "pgbench"), "-n", "-h", "127.0.0.1", "-p", str(port_of(ctx, target)), "-U", "app",
           "-M", qmode, "-f", str(script_file(ctx, script, n)), "-c", str(CLIENTS), "-j", str(THREADS),
           *length, "-l", f"--log-prefix={prefix}", db_of(n)]
    env = dict(os.environ, PGPASSWORD=APP_PASSWORD, PGSSLMODE="disable")
    rec = {"phase": phase, "script": script, "query_mode": qmode, "orgs": n, "target": target, "rep": rep,
           "clients": CLIENTS, "threads": THREADS, "seconds": seconds, "transactions_per_client": transactions,
           "command": "PGPASSWORD=*** PGSSLMODE=disable " + shlex.join(cmd)}
    pt0, pn0, ct0 = cpu_ticks(ctx.proxy.pid), sched_ns(ctx.proxy.pid), tree_ticks(ctx.cloud.proc.pid)
    load0 = loadavg()
    t0 = time.time()
    stdout, stderr, rc, timed_out = run_captured(cmd, (seconds or 0) + 180, env=env, cwd=logdir)
    wall = time.time() - t0
    # pgbench's own backends (direct) exit as it ends: let the postmaster reap them, so their
    # CPU is in its cutime when read (a trial run read one direct run at 4 µs per statement).
    time.sleep(0.3)
    pt1, pn1, ct1 = cpu_ticks(ctx.proxy.pid), sched_ns(ctx.proxy.pid), tree_ticks(ctx.cloud.proc.pid)
    rec.update(parse_pgbench(stdout))
    rec.update(txn_log(prefix))
    shutil.rmtree(logdir, ignore_errors=True)
    rec["returncode"] = rc
    rec["wall_seconds"] = round(wall, 2)
    rec["loadavg_1min_before_after"] = [load0, loadavg()]
    tx = rec.get("transactions") or 0
    rec["proxy_ticks"] = delta(pt0, pt1)
    rec["proxy_ns"] = delta(pn0, pn1)
    rec["cloud_ticks"] = delta(ct0, ct1)
    clk = CLK_TCK
    rec["proxy_us_per_stmt"] = round(rec["proxy_ns"] / 1e3 / tx, 2) if tx and rec["proxy_ns"] is not None else None
    rec["proxy_us_per_stmt_ticks"] = (round(rec["proxy_ticks"] / clk * 1e6 / tx, 2)
                                      if tx and rec["proxy_ticks"] is not None else None)
    rec["cloud_us_per_stmt"] = (round(rec["cloud_ticks"] / clk * 1e6 / tx, 1)
                                if tx and rec["cloud_ticks"] is not None else None)
    died = ([f"the proxy died during this run (exit {ctx.proxy.proc.returncode})"]
            if ctx.proxy.proc.poll() is not None else [])
    errors = pgbench_errors(rec, stdout, stderr, rc, timed_out, (seconds or 0) + 180, died, stdout_lines=20)
    rec["ok"] = bool(tx) and rc == 0 and not timed_out and ctx.proxy.proc.poll() is None
    ctx.runs.append(rec)
    log(f"  {phase:<7} {script:<6} {qmode:<8} N={n:<5} {target:<7} tps={rec.get('tps')} "
        f"(2nd half {rec.get('tps_second_half')}) p50={rec.get('p50_ms')}ms "
        f"proxy={rec['proxy_us_per_stmt']}µs cloud={rec['cloud_us_per_stmt']}µs/stmt "
        + ("ok" if rec["ok"] and not errors else f"ERROR ({rec.get('error')}) {rec.get('first_error', '')}"))
    return rec
