#!/usr/bin/env python3
"""LokaDB organizations benchmark: the cost of a statement against the number of organizations.

    LOKADB_BENCH_TARGET=/work/target/release /work/main/.venv/bin/python research/bench/orgs.py [--quick]

One cloud cluster (PostgreSQL 18) holds one LokaDB world per number of organizations N (full
1, 100, 1000, 3000; quick 1 and 1000), each in its own database `app_<N>`: the table
`documents` (as run.py's) made a LokaDB table by `lokadb init` + `lokadb enable documents`,
then N organizations that are not plain cloud ones, as a first `lokadb move-org` and a
`lokadb move-back` leave them — a row in `lokadb.org` (state 'cloud', with its postgres_fdw
server and user mapping, as `lokadb org add` makes them) and, by `--layout`:
- `folded` (default): their rows in DEFAULT, as `move-back` leaves a small organization (it
  folds it, proxy/src/admin/moves/fold.rs);
- `partitioned`: a partition of their own (`documents__lokadb_<id>`, LIST, holding the cloud
  partition `documents__lokadb_<id>_c` with its CHECK and the DEFAULT partition's indexes), as
  `move-back --fold-max-rows 0` leaves them —
built directly in SQL with the statements of proxy/src/admin/moves/{layout,split}.rs. A
fidelity check (real `org add`, `move-org`, `move-back` of one organization through a relay
and an agent, in a scratch database) compares the catalog that leaves with the one the SQL
builds. The same 60,000 rows are spread over the N
organizations at every N (plus 4,000 rows of plain cloud organizations in DEFAULT).

One `lokadb proxy` serves all the worlds (one `databases` entry per world, defaults otherwise).
Before measuring, the proxy's pooled cloud backends are warmed (each opens every partition).
pgbench (32 clients, -j 2; read, update, insert, and `route` — the proxy's path with a
statement the cloud prunes to nothing, at a fixed rate; -M simple, extended, prepared) runs
through the proxy and straight at the cloud, side by side, every N interleaved in each
repetition: tps, proxy ÷ direct, tps at N ÷ tps at N = 1, and the proxy's (and the cloud's)
CPU per statement. The cloud runs with max_locks_per_transaction = 2048 and autovacuum off.
Then the first statement after connecting (psycopg, SCRAM; connect and statement timed apart)
through the proxy and direct, and the cloud's planner at each N (planning time, plan cache).

Writes raw.json, summary.md and orgs-scaling.png into
research/bench/results/<UTC ts>-orgs[-partitioned][-quick]/ and the section "Organizations: cost
vs their number" (one per layout) of research/bench/charts-data.md.
Builds nothing: benchmarks the binaries in $LOKADB_BENCH_TARGET (default
/work/target-bench/release) and records their sha256. See research/bench/README.md,
"Organizations benchmark".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lib.binaries import AGENT_BIN, BIN_DIR, LOKADB_BIN, PG_BIN, bin_dir_of, binaries_at_end, binary_info  # noqa: E402
from lib.charts import REFERENCE_STYLE, goal_line, reference_line, save_png  # noqa: E402
from lib.clusters import APP_PASSWORD, ORG_PG, PgCluster, cluster_root, lokadb, org_database  # noqa: E402
from lib.numbers import fmt, med, percentile  # noqa: E402
from lib.orgs_world import (  # noqa: E402
    ANSI, CLIENTS, CLOUD_PG, INDEX_DDL, MAX_LOCKS, ORG_DBNAME, PLAIN_ORGS, PLAIN_ROWS, PROXY_LOG, ROUTE_RATE, SCRIPTS,
    SCRIPT_TEXT, TABLE_DDL, THREADS, TOTAL_ROWS, WARM_SCRIPT, Mode, app_conn, build_world, create_orgs, db_of,
    default_indexes, metadata_lines, partitioned, pgbench, port_of, start_cloud, start_proxy, wait_metadata,
)
from lib.procs import (  # noqa: E402
    catch_signals, ignore_signals, log, preflight, raise_fd_limit, rss_kib, safe_cleanup, sched_ns, temp_dir,
)
from lib.relay import Relay, make_certs, new_token, start_agent, stop_agents  # noqa: E402
from lib.results import (  # noqa: E402
    Ctx, fatal, git_info, machine_info, rerender, result_dir, save_rendered, write_charts_section, write_outputs,
)

import psycopg  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402  (lib set the Agg backend)

WARM_PSYCOPG = 4  # pooled backends warmed for psycopg's connections before the first-statement test
TARGETS = ["direct", "lokadb"]
SCRIPT_LABEL = {"read": "read", "update": "update", "insert": "insert", "route": "route (proxy path only)"}
ROUTE_SECONDS = 3  # the route script (at ROUTE_RATE) runs at most this long


READ_SQL = ("SELECT id, organization_id, title, updated_at FROM documents "
            "WHERE organization_id = %s AND id = %s")


def org_of(i: int, n: int) -> int:
    """The organization of document id i (1..TOTAL_ROWS) in the world of n organizations."""
    return 1 + (i - 1) % n


# --------------------------------------------------------------------------------------
# Fidelity: one organization through the real commands vs one built by org_sql


SIGNATURE_SQL = {
    "relations": """
        SELECT c.relname::text, c.relkind::text, pg_get_userbyid(c.relowner)::text, c.relpersistence::text,
               coalesce(pg_get_expr(c.relpartbound, c.oid), ''), coalesce(pg_get_partkeydef(c.oid), ''),
               coalesce((SELECT p.relname::text FROM pg_inherits h JOIN pg_class p ON p.oid = h.inhparent
                         WHERE h.inhrelid = c.oid), ''),
               coalesce(array_to_string(c.reloptions, ','), '')
        FROM pg_class c WHERE c.relname LIKE %(pat)s AND c.relkind IN ('r', 'p', 'f') ORDER BY 1""",
    "columns": """
        SELECT c.relname::text, a.attnum, a.attname::text, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               coalesce(pg_get_expr(d.adbin, d.adrelid), ''), a.attstorage::text, a.attisdropped
        FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0
        LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
        WHERE c.relname LIKE %(pat)s AND c.relkind IN ('r', 'p', 'f') ORDER BY 1, 2""",
    "constraints": """
        SELECT c.relname::text, k.conname::text, k.contype::text, pg_get_constraintdef(k.oid), k.convalidated,
               k.conislocal, k.coninhcount
        FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
        WHERE c.relname LIKE %(pat)s ORDER BY 1, 2""",
    "indexes": """
        SELECT c.relname::text, i.relname::text, pg_get_indexdef(x.indexrelid), x.indisprimary, x.indisunique,
               x.indisvalid, coalesce((SELECT p.relname::text FROM pg_inherits h JOIN pg_class p ON p.oid = h.inhparent
                                       WHERE h.inhrelid = i.oid), '')
        FROM pg_index x JOIN pg_class c ON c.oid = x.indrelid JOIN pg_class i ON i.oid = x.indexrelid
        WHERE c.relname LIKE %(pat)s ORDER BY 1, 2""",
    "triggers": """
        SELECT c.relname::text, t.tgname::text, t.tgenabled::text, t.tgtype, t.tgfoid::regproc::text,
               t.tgparentid <> 0, t.tgisinternal
        FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        WHERE c.relname LIKE %(pat)s ORDER BY 1, 2""",
    "lokadb_org": """
        SELECT state, profile, server::text, relay_host, dbname, name IS NULL
        FROM lokadb.org WHERE id = %(org)s""",
    "server": """
        SELECT s.srvname::text, array_to_string(s.srvoptions, ','), w.fdwname::text,
               (SELECT array_to_string(um.umoptions, ',') FROM pg_user_mapping um
                WHERE um.umserver = s.oid AND um.umuser = 0)
        FROM pg_foreign_server s JOIN pg_foreign_data_wrapper w ON w.oid = s.srvfdw
        WHERE s.srvname = 'lokadb_org_' || %(org)s""",
    "key_map_rows": "SELECT count(*) FROM lokadb.km_documents_id WHERE organization_id = %(org)s::int",
    "rows": "SELECT count(*) FROM documents WHERE organization_id = %(org)s::int",
    "moves_journal": "SELECT count(*) FROM lokadb.moves WHERE org = %(org)s",
    "pause_rows": "SELECT count(*) FROM lokadb.pause WHERE org = %(org)s",
    "functions_named_for_org": """
        SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = 'lokadb' AND p.proname LIKE '%%\\_' || %(org)s || '\\_%%'""",
    "change_records": "SELECT count(*) FROM lokadb.changes",
    "default_partition_triggers": """
        SELECT t.tgname::text, t.tgenabled::text, t.tgparentid <> 0
        FROM pg_trigger t WHERE t.tgrelid = 'documents__lokadb_default'::regclass AND NOT t.tgisinternal ORDER BY 1""",
}


def signature(c, org: str) -> dict:
    pat = f"documents\\_\\_lokadb\\_{org}%"
    out = {}
    for k, s in SIGNATURE_SQL.items():
        params = {"pat": pat, "org": org} if "%(" in s else None
        rows = c.execute(s, params).fetchall()
        text = json.dumps([list(r) for r in rows], default=str)
        # The organization's id, wherever it appears (names, bounds, CHECK, server, dbname).
        text = re.sub(rf"(?<![0-9]){org}(?![0-9])", "<org>", text).replace(APP_PASSWORD, "***")
        out[k] = json.loads(text)
    return out


def fidelity_check(ctx) -> dict:
    """In a scratch database: organization REAL through `lokadb org add`, `move-org`, `move-back`
    (relay, agent, an organization cluster), organization SYNTH through org_sql; both with 20
    documents, loaded the way each path loads them. Returns their catalog signatures and the
    differences."""
    REAL, SYNTH = "7001", "7002"
    res = {"real_org": REAL, "synthetic_org": SYNTH, "timings_s": {}}
    T = res["timings_s"]
    t0 = time.time()
    db = "fidelity"
    root = cluster_root(ctx.tmp / "fidelity")
    org = PgCluster(root, "org", ctx.commands).create(ORG_PG)
    org_database(org)  # the role app and its database ORG_DBNAME
    certs = make_certs(ctx.tmp, ctx.commands)
    token, token_hash = new_token(REAL)
    agent_log = open(ctx.tmp / "agent.stderr.log", "ab")
    relay = Relay(ctx.tmp, certs, {REAL: token_hash}, {}, ctx.commands, tag="relay-fidelity")
    agent = start_agent(f"127.0.0.1:{relay.agents_port}", token, org.addr(), certs["ca"], {}, agent_log)
    try:
        relay.wait_connected(1)
        with ctx.cloud.conn() as c:
            c.execute(f"CREATE DATABASE {db} OWNER app")
        with app_conn(ctx.cloud.port, db) as c:
            c.execute(TABLE_DDL)
            c.execute(INDEX_DDL)
        dsn = ctx.cloud.dsn(db)
        lokadb(ctx, ["init"], dsn)
        lokadb(ctx, ["enable", "documents"], dsn)
        # The synthetic organization first (its partition is created before its rows), then
        # rows of both (REAL's land in DEFAULT, as an organization's before its first move).
        with ctx.cloud.conn(db) as c:
            T["synthetic_create"] = create_orgs(c, [SYNTH], default_indexes(c), ctx.commands,
                                                relay_port=relay.pg_port, partitioned=partitioned(ctx))
        with app_conn(ctx.cloud.port, db) as c:
            for o in (REAL, SYNTH):
                c.execute(f"""INSERT INTO documents (organization_id, title, body)
                              SELECT {o}, 'document ' || g, repeat(md5(g::text), 6) FROM generate_series(1, 20) g""")
        t = time.time()
        lokadb(ctx, ["org", "add", REAL, "--via-relay", f"127.0.0.1:{relay.pg_port}", "--dbname", ORG_DBNAME,
                     "--user", "app", "--password", APP_PASSWORD], dsn)
        r1 = lokadb(ctx, ["move-org", REAL], dsn, timeout=600)
        # 20 rows: move-back folds it, unless told to keep its partitions.
        r2 = lokadb(ctx, ["move-back", REAL] + ([] if not partitioned(ctx) else ["--fold-max-rows", "0"]), dsn,
                    timeout=600)
        T["real_org_add_move_org_move_back"] = round(time.time() - t, 2)
        res["move_org_output"] = (r1.stdout + r1.stderr).strip().splitlines()[-12:]
        res["move_back_output"] = (r2.stdout + r2.stderr).strip().splitlines()[-12:]
        with ctx.cloud.conn(db) as c:
            sig_real = signature(c, REAL)
            sig_synth = signature(c, SYNTH)
            # The synthetic row's pg_version is a label; the real one's is the org server's.
            res["lokadb_org_rows"] = [list(map(str, r)) for r in c.execute(
                "SELECT id, state, profile, server, relay_host, relay_port, dbname, pg_version FROM lokadb.org "
                "ORDER BY id").fetchall()]
    finally:
        stop_agents([agent])
        relay.stop()
        org.stop()
    with ctx.cloud.conn() as c:
        c.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
    diffs = {}
    for k in sig_real:
        if sig_real[k] != sig_synth[k]:
            diffs[k] = {"real": sig_real[k], "synthetic": sig_synth[k]}
    res["signature_real"] = sig_real
    res["differences"] = diffs
    res["identical"] = not diffs
    T["total"] = round(time.time() - t0, 2)
    log(f"  fidelity: real move-org + move-back of {REAL} vs synthetic {SYNTH}: "
        + ("identical catalogs" if not diffs else f"DIFFERENT in {sorted(diffs)}") + f" ({T['total']} s)")
    return res


# --------------------------------------------------------------------------------------
# The first statement after connecting, and the cloud's planner


def first_statements(ctx, n: int) -> dict:
    """psycopg, SCRAM as app: connect (timed), one read (timed: the first statement), a second
    read (timed), close; alternating direct and through the proxy, first_n times each. Direct,
    each connection is a new backend; through the proxy, a pooled one (warmed first)."""
    rng = random.Random(1000 + n)
    out = {"orgs": n, "n": ctx.mode.first_n, "sql": READ_SQL, "targets": {}}
    # psycopg's connections have other startup parameters than pgbench's, so other pooled
    # backends: warm a few the way the pgbench pool was (held at once, so distinct backends;
    # each opens every partition), as an application's pool would be after a while.
    held = [app_conn(ctx.proxy.port, db_of(n)) for _ in range(WARM_PSYCOPG)]
    for c in held:
        c.execute("SELECT count(*) FROM documents WHERE id < 0").fetchall()
    for c in held:
        c.close()
    out["proxy_backends_warmed"] = WARM_PSYCOPG
    acc = {t: {"connect_ms": [], "first_ms": [], "second_ms": [], "proxy_ns": [], "errors": []} for t in TARGETS}
    for k in range(ctx.mode.first_n):
        order = TARGETS if k % 2 == 0 else TARGETS[::-1]
        for t in order:
            i1, i2 = rng.randint(1, TOTAL_ROWS), rng.randint(1, TOTAL_ROWS)
            a = acc[t]
            ns0 = sched_ns(ctx.proxy.pid)
            try:
                t0 = time.perf_counter()
                c = app_conn(port_of(ctx, t), db_of(n))
                t1 = time.perf_counter()
                rows1 = c.execute(READ_SQL, (org_of(i1, n), i1)).fetchall()
                t2 = time.perf_counter()
                rows2 = c.execute(READ_SQL, (org_of(i2, n), i2)).fetchall()
                t3 = time.perf_counter()
                c.close()
                if len(rows1) != 1 or len(rows2) != 1:
                    a["errors"].append(f"expected one row each, got {len(rows1)} and {len(rows2)}")
                a["connect_ms"].append((t1 - t0) * 1e3)
                a["first_ms"].append((t2 - t1) * 1e3)
                a["second_ms"].append((t3 - t2) * 1e3)
            except Exception as e:  # noqa: BLE001
                a["errors"].append(repr(e)[:300])
            ns1 = sched_ns(ctx.proxy.pid)
            if ns0 is not None and ns1 is not None:
                a["proxy_ns"].append(ns1 - ns0)
    for t, a in acc.items():
        e = {"runs": len(a["connect_ms"]), "errors": a["errors"][:5], "error_count": len(a["errors"])}
        for k in ("connect_ms", "first_ms", "second_ms"):
            v = sorted(a[k])
            e[k + "_p50"] = round(percentile(v, 0.5), 3) if v else None
            e[k + "_p90"] = round(percentile(v, 0.9), 3) if v else None
            e[k] = [round(x, 3) for x in a[k]]
        e["proxy_us_per_connection"] = round(statistics.median(a["proxy_ns"]) / 1e3, 1) if a["proxy_ns"] else None
        out["targets"][t] = e
    d, p = out["targets"]["direct"], out["targets"]["lokadb"]
    log(f"  first statement N={n}: direct connect {d['connect_ms_p50']} ms, first {d['first_ms_p50']} ms, second "
        f"{d['second_ms_p50']} ms | LokaDB connect {p['connect_ms_p50']} ms, first {p['first_ms_p50']} ms, second "
        f"{p['second_ms_p50']} ms, proxy {p['proxy_us_per_connection']} µs CPU per connection")
    for t in TARGETS:
        if out["targets"][t]["error_count"]:
            ctx.errors.append(f"first statement N={n} via {t}: {out['targets'][t]['error_count']} errors, e.g. "
                              f"{out['targets'][t]['errors'][0]}")
    return out


PLAN_RE = re.compile(r"Planning Time: ([\d.]+) ms")


def id_of(org: int, n: int, rng: random.Random) -> int:
    """A document id of organization `org` (ids i with 1 + (i-1) % n = org)."""
    return org + n * rng.randrange(TOTAL_ROWS // n)


def select1(c, k=300) -> float:
    """p50 of k round trips of `SELECT 1` (simple protocol) on this connection, ms."""
    ts = []
    for _ in range(k):
        t0 = time.perf_counter()
        c.execute("SELECT 1", prepare=False).fetchall()
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return round(percentile(ts, 0.5), 4)


def planner(ctx, n: int) -> dict:
    """Straight at the cloud, one fresh backend as app. Planning time of the read with literals:
    the backend's first statement; then 20 organizations this backend has not touched (the first
    use of a partition in a backend opens it: relation, indexes, triggers, statistics); then,
    after one statement that plans over every partition (opening them all), 20 random ones
    (warm). Then the plan cache's choice for the read, update and insert prepared (10 executions
    each, in a transaction rolled back) and how many relations one execution locks."""
    rng = random.Random(2000 + n)
    out = {"orgs": n}
    orgs = list(range(1, n + 1))
    rng.shuffle(orgs)

    def explain(c, org: int) -> float | None:
        i = id_of(org, n, rng)
        text = "\n".join(r[0] for r in c.execute(
            f"EXPLAIN (SUMMARY) SELECT id, organization_id, title, updated_at FROM documents "
            f"WHERE organization_id = {org} AND id = {i}").fetchall())
        out["explain_read_literal"] = text.splitlines()[:12]
        m = PLAN_RE.search(text)
        return float(m.group(1)) if m else None

    # prepare_threshold=None: psycopg prepares nothing itself; the PREPAREs below are the probe.
    with app_conn(ctx.cloud.port, db_of(n), prepare_threshold=None) as c:
        out["planning_ms_first_in_backend"] = explain(c, orgs[0])
        untouched = [orgs[1 + k % max(1, n - 1)] if n > 1 else orgs[0] for k in range(20)]
        out["planning_ms_first_touch_p50"] = med([explain(c, o) for o in untouched])
        out["first_touch_defined"] = n > 20  # with fewer organizations some were touched already
        out["select1_ms_p50_before_touch_all"] = select1(c)
        t0 = time.perf_counter()
        c.execute("SELECT count(*) FROM documents WHERE id < 0").fetchall()
        out["touch_all_partitions_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
        # The same trivial statement once this backend has locked and opened every partition
        # (what a warmed pooled backend has been through): per-transaction costs that grow with
        # what the backend holds (its local lock table, its caches) show here.
        out["select1_ms_p50_after_touch_all"] = select1(c)
        out["planning_ms_warm_p50"] = med([explain(c, rng.choice(orgs)) for _ in range(20)])
        c.execute("PREPARE r(int, bigint) AS SELECT id, organization_id, title, updated_at FROM documents "
                  "WHERE organization_id = $1 AND id = $2")
        c.execute("PREPARE u(int, bigint) AS UPDATE documents SET title = 'planner probe', updated_at = now() "
                  "WHERE organization_id = $1 AND id = $2")
        c.execute("PREPARE i(int) AS INSERT INTO documents (organization_id, title, body) "
                  "VALUES ($1, 'planner probe', 'planner probe')")

        def args(name):
            o = rng.choice(orgs)
            return f"{o}" if name == "i" else f"{o}, {id_of(o, n, rng)}"

        exec_ms = {"r": [], "u": [], "i": []}
        c.execute("BEGIN")
        try:
            for _ in range(10):
                for name in ("r", "u", "i"):
                    a = args(name)
                    t0 = time.perf_counter()
                    c.execute(f"EXECUTE {name}({a})")
                    exec_ms[name].append((time.perf_counter() - t0) * 1e3)
            out["plan_cache"] = {r[0]: {"generic_plans": r[1], "custom_plans": r[2]} for r in c.execute(
                "SELECT name, generic_plans, custom_plans FROM pg_prepared_statements "
                "WHERE name IN ('r', 'u', 'i') ORDER BY name").fetchall()}
            out["explain_execute_r"] = [r[0] for r in c.execute(
                f"EXPLAIN (COSTS OFF) EXECUTE r({args('r')})").fetchall()][:12]
        finally:
            c.execute("ROLLBACK")
        # Relations one execution locks, in a transaction of its own (a generic plan without
        # plan-time pruning locks every partition; a custom plan the ones it keeps).
        out["relation_locks_one_execute"] = {}
        for name in ("r", "u", "i"):
            c.execute("BEGIN")
            try:
                c.execute(f"EXECUTE {name}({args(name)})")
                out["relation_locks_one_execute"][name] = c.execute(
                    "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'relation'"
                    " AND relation <> 'pg_locks'::regclass").fetchone()[0]
            finally:
                c.execute("ROLLBACK")
        out["execute_ms_first"] = {k: round(v[0], 3) for k, v in exec_ms.items()}
        out["execute_ms_p50_last5"] = {k: round(med(v[5:]), 3) for k, v in exec_ms.items()}
        out["backend_memory_mb"] = None
        try:  # PG 14+: this backend's memory contexts (the relcache of N partitions lives there)
            out["backend_memory_mb"] = round(float(c.execute(
                "SELECT sum(total_bytes) FROM pg_backend_memory_contexts").fetchone()[0]) / 1e6, 1)
        except psycopg.Error:
            pass
    log(f"  planner N={n}: planning {out['planning_ms_first_in_backend']} ms first in a backend, "
        f"{out['planning_ms_first_touch_p50']} ms first touch of a partition, {out['planning_ms_warm_p50']} ms warm; "
        f"touching all {out['touch_all_partitions_ms']} ms; SELECT 1 {out['select1_ms_p50_before_touch_all']} ms "
        f"before, {out['select1_ms_p50_after_touch_all']} ms after; plan cache {out['plan_cache']}; relations locked by one "
        f"execution {out['relation_locks_one_execute']}; backend memory {out['backend_memory_mb']} MB")
    return out


# --------------------------------------------------------------------------------------
# Summaries


def summarize(raw: dict) -> dict:
    ms = raw["meta"]["mode_settings"]
    runs = [r for r in raw["runs"] if r["phase"] == "measure"]
    Ns, qmodes = ms["orgs"], ms["query_modes"]
    scripts = ms.get("scripts", SCRIPTS)
    base = min(Ns)
    cells = []
    for script in scripts:
        for qm in qmodes:
            for n in Ns:
                rs = [r for r in runs if r["script"] == script and r["query_mode"] == qm and r["orgs"] == n]
                cell = {"script": script, "query_mode": qm, "orgs": n, "targets": {}}
                for t in TARGETS:
                    tr = [r for r in rs if r["target"] == t]
                    ok = [r for r in tr if r["ok"]]
                    cell["targets"][t] = {
                        "runs": len(tr), "ok_runs": len(ok),
                        "errors": sorted({r.get("error", "") for r in tr if r.get("error")}),
                        "first_errors": sorted({re.sub(r"client \d+ ", "", r.get("first_error", ""))
                                                for r in tr if r.get("error")} - {""}),
                        "tps": med([r["tps"] for r in ok]),
                        "tps_second_half": med([r.get("tps_second_half") for r in ok]),
                        "p50_ms": med([r["p50_ms"] for r in ok]),
                        "p99_ms": med([r["p99_ms"] for r in ok]),
                        "proxy_us_per_stmt": med([r["proxy_us_per_stmt"] for r in ok]),
                        "cloud_us_per_stmt": med([r["cloud_us_per_stmt"] for r in ok]),
                    }
                by_rep = {}
                for r in rs:
                    by_rep.setdefault(r["rep"], {})[r["target"]] = r
                ratios = [d["lokadb"]["tps"] / d["direct"]["tps"] for d in by_rep.values()
                          if all(d.get(t) and d[t]["ok"] and d[t]["tps"] for t in TARGETS)]
                cell["proxy_over_direct"] = med(ratios)
                cell["proxy_over_direct_per_rep"] = [round(x, 4) for x in ratios]
                cells.append(cell)
    # tps at N ÷ tps at the smallest N, per repetition (runs of the same repetition), median
    for cell in cells:
        for t in TARGETS:
            per_rep = []
            for rep in range(ms["reps"]):
                def tps_of(n):
                    r = [x for x in runs if x["script"] == cell["script"] and x["query_mode"] == cell["query_mode"]
                         and x["orgs"] == n and x["target"] == t and x["rep"] == rep and x["ok"]]
                    return r[0]["tps"] if r else None
                a, b = tps_of(base), tps_of(cell["orgs"])
                if a and b is not None:
                    per_rep.append(b / a)
            cell["targets"][t]["over_base"] = med(per_rep)
            cell["targets"][t]["over_base_per_rep"] = [round(x, 4) for x in per_rep]
    s = {"base": base, "orgs": Ns, "query_modes": qmodes, "scripts": scripts, "cells": cells,
         "first": {f["orgs"]: f for f in raw.get("first_statements", [])},
         "planner": {p["orgs"]: p for p in raw.get("planner", [])}}
    # JSON turns the int keys into strings: accept both when rendering from raw.json.
    s["first"] = {int(k): v for k, v in s["first"].items()}
    s["planner"] = {int(k): v for k, v in s["planner"].items()}
    top = max(Ns)
    goals = []
    for script in [x for x in scripts if x != "route"]:
        for qm in qmodes:
            c = cell_of(s, script, qm, top)
            v = c["targets"]["lokadb"]["over_base"] if c else None
            goals.append({"what": f"{script} {qm}: LokaDB tps at {top} ÷ at {base}", "value": v, "goal": ">= 0.9",
                          "met": (v >= 0.9) if v is not None else None})
    f = s["first"]
    if top in f and base in f:
        a, b = f[base]["targets"]["lokadb"]["first_ms_p50"], f[top]["targets"]["lokadb"]["first_ms_p50"]
        v = b / a if a and b is not None else None
        goals.append({"what": f"first statement after connecting through LokaDB, p50 at {top} ÷ at {base}",
                      "value": v, "goal": "<= 2", "met": (v <= 2) if v is not None else None})
        a, b = f[base]["targets"]["direct"]["first_ms_p50"], f[top]["targets"]["direct"]["first_ms_p50"]
        s["direct_first_ratio"] = b / a if a and b is not None else None
    s["goals"] = goals
    return s


def cell_of(s, script, qm, n):
    for c in s["cells"]:
        if c["script"] == script and c["query_mode"] == qm and c["orgs"] == n:
            return c
    return None


def checks(raw: dict, s: dict) -> list[str]:
    """What looks wrong, computed from the numbers (flags to look at, not verdicts on noise)."""
    out = []
    base, top = s["base"], max(s["orgs"])
    for script in s["scripts"]:
        for qm in s["query_modes"]:
            for n in s["orgs"]:
                c = cell_of(s, script, qm, n)
                for t in TARGETS:
                    if c and c["targets"][t]["errors"]:
                        out.append(f"{script} {qm} N={n} via {t}: {c['targets'][t]['ok_runs']} of "
                                   f"{c['targets'][t]['runs']} runs ok; "
                                   + "; ".join(c["targets"][t]["first_errors"])[:300])
    if top == base:
        return out
    for script in s["scripts"]:
        for qm in s["query_modes"]:
            a, b = cell_of(s, script, qm, base), cell_of(s, script, qm, top)
            if not a or not b:
                continue
            pa, pb = a["targets"]["lokadb"]["proxy_us_per_stmt"], b["targets"]["lokadb"]["proxy_us_per_stmt"]
            lo = b["targets"]["lokadb"]["over_base"]
            if pa and pb and pb > 1.10 * pa and pb - pa > 1.5:
                why = ("the cloud's work does not change with N here: the proxy's own cost"
                       if script == "route" else
                       f"at {fmt(lo, 2)} × the throughput (fewer statements per wake-up also cost per statement)")
                out.append(f"proxy CPU per statement, {script} {qm}: {pa:.1f} µs at {base} → {pb:.1f} µs at {top} "
                           f"(+{100 * (pb / pa - 1):.0f} %; {why})")
    for c in s["cells"]:
        if c["script"] == "route":
            for t in TARGETS:
                tps = c["targets"][t]["tps"]
                if tps is not None and tps < 0.95 * ROUTE_RATE:
                    out.append(f"route {c['query_mode']} N={c['orgs']} via {t}: {tps:,.0f} tps, below the fixed rate "
                               f"{ROUTE_RATE:,} (the CPU per statement then compares less well)")
    f = s["first"]
    if base in f and top in f:
        pa = f[base]["targets"]["lokadb"]["proxy_us_per_connection"]
        pb = f[top]["targets"]["lokadb"]["proxy_us_per_connection"]
        if pa and pb and pb > 1.3 * pa and pb - pa > 20:
            out.append(f"proxy CPU per connection (connect + 2 reads) grows: {pa:.0f} µs at {base} → {pb:.0f} µs at {top}")
    w = raw.get("fidelity") or {}
    if w and not w.get("identical", True):
        out.append(f"the synthetic organizations differ from a real move-org + move-back in: {sorted(w['differences'])}")
    return out


def summary_markdown(raw: dict, s: dict) -> str:
    m = raw["meta"]
    ms = m["mode_settings"]
    L = [f"# Organizations benchmark, {m['mode']} mode — run {m['run_id']}", ""]
    if m["mode"] == "quick":
        L += ["**Quick mode: one repetition of short runs, N = 1 and 1000 only — indicative only; quote the full "
              "mode.**", ""]
    L += [f"Commit `{m['git']['commit'][:12]}`{' (dirty tree)' if m['git']['dirty'] else ''}, "
          f"{m['machine']['nproc']} cores (shared), load average at start {m['machine']['loadavg_at_start']}, "
          f"at the end {m.get('loadavg_at_end', '?')}; {m.get('wall_seconds', 0):.0f} s in all. Binaries: `{bin_dir_of(m, BIN_DIR)}` "
          f"(lokadb sha256 `{m['binaries']['lokadb']['sha256'][:16]}…`, mtime {m['binaries']['lokadb']['mtime_utc']}). "
          f"Command: `{m['command']}`.", ""]
    L += [f"Worlds: one cloud PostgreSQL 18 cluster (`max_locks_per_transaction = {ms.get('max_locks')}`), one "
          f"database per N (`app_<N>`): `documents` enabled by `lokadb enable`, N organizations each with a "
          f"`lokadb.org` row (state 'cloud') and its postgres_fdw server, "
          + ("a partition of their own (layout `partitioned`: as `move-back --fold-max-rows 0` leaves them)"
             if ms.get("layout", "partitioned") == "partitioned" else
             "their rows in DEFAULT (layout `folded`: as `move-back` leaves a small organization)")
          + f", {TOTAL_ROWS:,} documents spread over them "
          f"({TOTAL_ROWS:,} ÷ N each) plus {PLAIN_ROWS:,} of {PLAIN_ORGS} plain cloud organizations in DEFAULT. One "
          f"`lokadb proxy`, "
          + ("defaults" if ms.get("statement_org", True) else "`\"statement_org\": false`, otherwise defaults")
          + f", a `databases` entry per world. pgbench {CLIENTS} clients, -j {THREADS}, "
          f"{ms['seconds']} s per run, R = {ms['reps']}; medians over repetitions; ratios per repetition from runs "
          f"of the same repetition. Direct runs start with {CLIENTS} new backends; through the proxy the pooled "
          f"backends were warmed first (every partition opened in each).", ""]
    for w in raw.get("worlds", []):
        cnt = w.get("counts", {})
        L.append(f"- `{w['database']}`: {w['orgs']:,} organizations ({cnt.get('partitions_in_tree')} relations in the "
                 f"partition tree, {cnt.get('rows_per_org_min_max')} rows each, {cnt.get('pg_class_rows')} pg_class "
                 f"rows), built in {w['timings_s'].get('total')} s (organizations {w['timings_s'].get('create_orgs')} s)"
                 + (f"; PROBLEMS: {'; '.join(w['problems'])}" if w.get("problems") else ""))
    L.append("")
    fid = raw.get("fidelity")
    if fid:
        L.append(f"Fidelity check: organization {fid['real_org']} through `lokadb org add` + `move-org` + "
                 f"`move-back`, organization {fid['synthetic_org']} through this script's SQL, same database: "
                 + ("**identical catalog signatures** (partition tree and bounds, owners, columns and defaults, "
                    "constraints, indexes, triggers, lokadb.org row, postgres_fdw server and user mapping, key map "
                    "rows; no journal, pause, capture function or change record left)." if fid.get("identical") else
                    f"**differences in {', '.join(sorted(fid['differences']))}** (see raw.json, `fidelity`)."))
        L.append("")
    L.append("## Throughput, 32 clients\n")
    L.append(f"tps: pgbench's (whole run), in brackets the run's second half (from the per-transaction log); "
             f"`÷ direct` = LokaDB ÷ direct; `N ÷ {s['base']}` = tps at N ÷ tps at {s['base']} of the same target; "
             f"CPU per statement: the proxy (schedstat, all threads) and the cloud (postmaster and children, 10 ms "
             f"ticks) in the LokaDB run / the cloud in the direct run. `route` = the proxy's path only (the cloud "
             f"prunes every partition at planning), at a fixed {ROUTE_RATE:,} statements/s (pgbench -R, at most "
             f"{ROUTE_SECONDS} s per run): its tps "
             f"ratios say nothing, its CPU per statement and latency compare across N.\n")
    L.append(f"| script | mode | N | direct tps | LokaDB tps | ÷ direct | direct N ÷ {s['base']} | LokaDB N ÷ {s['base']} "
             "| proxy µs/stmt | cloud µs/stmt LokaDB / direct | LokaDB p50 / p99 ms |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in s["cells"]:
        d, p = c["targets"]["direct"], c["targets"]["lokadb"]
        L.append(f"| {c['script']} | {c['query_mode']} | {c['orgs']:,} | {fmt(d['tps'], 0)} ({fmt(d['tps_second_half'], 0)}) "
                 f"| {fmt(p['tps'], 0)} ({fmt(p['tps_second_half'], 0)}) | {fmt(c['proxy_over_direct'], 3)} | "
                 f"{fmt(d['over_base'], 3)} | **{fmt(p['over_base'], 3)}** | {fmt(p['proxy_us_per_stmt'], 1)} | "
                 f"{fmt(p['cloud_us_per_stmt'], 0)} / {fmt(d['cloud_us_per_stmt'], 0)} | {fmt(p['p50_ms'], 2)} / "
                 f"{fmt(p['p99_ms'], 2)} |")
    L.append("")
    L.append("## First statement after connecting\n")
    L.append(f"psycopg, SCRAM as `app`, a new connection each time ({ms['first_n']} per target and N, direct and "
             "through the proxy alternating): connect, the read with parameters (extended protocol, unnamed), a "
             "second read; p50 (p90) ms. Proxy CPU: schedstat µs per connection (connect + 2 reads + close), median. "
             f"Before it, {WARM_PSYCOPG} pooled backends for psycopg's connections were warmed like pgbench's.\n")
    L.append(f"| N | target | connect | first statement | second statement | first ÷ first at {s['base']} | proxy µs CPU |")
    L.append("|---:|---|---:|---:|---:|---:|---:|")
    for n in s["orgs"]:
        f = s["first"].get(n)
        if not f:
            continue
        for t in TARGETS:
            e = f["targets"][t]
            b = s["first"].get(s["base"], {}).get("targets", {}).get(t, {}).get("first_ms_p50")
            r = e["first_ms_p50"] / b if b and e["first_ms_p50"] is not None else None
            L.append(f"| {n:,} | {t} | {fmt(e['connect_ms_p50'], 2)} ({fmt(e['connect_ms_p90'], 2)}) | "
                     f"{fmt(e['first_ms_p50'], 2)} ({fmt(e['first_ms_p90'], 2)}) | {fmt(e['second_ms_p50'], 2)} "
                     f"({fmt(e['second_ms_p90'], 2)}) | {fmt(r, 2)} | "
                     f"{fmt(e['proxy_us_per_connection'], 0) if t == 'lokadb' else '—'} |")
    L.append("")
    if s["planner"]:
        L.append("## The cloud's planner (direct, one fresh backend per N)\n")
        L.append("Planning time of the read with literals (`EXPLAIN (SUMMARY)`): the backend's first statement; "
                 "p50 of 20 organizations it had not touched yet; p50 of 20 after one statement planned over every "
                 "partition (`SELECT count(*) FROM documents WHERE id < 0`, its time in its column); `SELECT 1` "
                 "round trip (p50 of 300) before and after that. Then the plan cache after 10 executions of each "
                 "prepared statement (in one transaction, rolled back), and the relations one execution locks.\n")
        L.append("| N | planning ms: first in backend / first touch / warm | touch all ms | `SELECT 1` ms before / after "
                 "touch all | plan cache generic/custom: read, update, insert | EXECUTE ms (p50 of last 5): read, update, "
                 "insert | relations locked by one EXECUTE: read, update, insert | backend memory MB |")
        L.append("|---:|---:|---:|---:|---|---|---|---:|")
        for n in s["orgs"]:
            p = s["planner"].get(n)
            if not p:
                continue
            pc = p.get("plan_cache", {})
            cache = ", ".join(f"{pc.get(k, {}).get('generic_plans')}/{pc.get(k, {}).get('custom_plans')}"
                              for k in ("r", "u", "i"))
            locks = ", ".join(fmt((p.get("relation_locks_one_execute") or {}).get(k)) for k in ("r", "u", "i"))
            ft = fmt(p.get("planning_ms_first_touch_p50"), 3) + ("" if p.get("first_touch_defined") else "*")
            ex = ", ".join(fmt((p.get("execute_ms_p50_last5") or {}).get(k), 3) for k in ("r", "u", "i"))
            L.append(f"| {n:,} | {fmt(p['planning_ms_first_in_backend'], 3)} / {ft} / "
                     f"{fmt(p.get('planning_ms_warm_p50'), 3)} | {fmt(p.get('touch_all_partitions_ms'), 1)} | "
                     f"{fmt(p.get('select1_ms_p50_before_touch_all'), 3)} / {fmt(p.get('select1_ms_p50_after_touch_all'), 3)} "
                     f"| {cache} | {ex} | {locks} | {fmt(p.get('backend_memory_mb'), 1)} |")
        if any(not p.get("first_touch_defined") for p in s["planner"].values()):
            L.append("\n\\* fewer than 21 organizations: those partitions had been touched already.")
        L.append("")
    md = raw.get("proxy_metadata") or {}
    if md:
        L.append("Proxy metadata (the watcher's `metadata loaded` lines at start): "
                 + "; ".join(f"{db}: {d.get('organizations')} organizations, load {fmt(float(d.get('load_ms') or 0), 1)} ms"
                             for db, d in sorted(md.items(), key=lambda kv: int(kv[0].split('_')[1])))
                 + f". Proxy RSS {fmt((raw.get('proxy_rss_kib_start') or 0) / 1024, 1)} MiB at start, "
                 f"{fmt((raw.get('proxy_rss_kib_end') or 0) / 1024, 1)} MiB at the end.\n")
    if "route" in s["scripts"] and max(s["orgs"]) != s["base"]:
        top = max(s["orgs"])
        parts = []
        for qm in s["query_modes"]:
            a, b = cell_of(s, "route", qm, s["base"]), cell_of(s, "route", qm, top)
            if a and b and a["targets"]["lokadb"]["proxy_us_per_stmt"] and b["targets"]["lokadb"]["proxy_us_per_stmt"]:
                pa, pb = a["targets"]["lokadb"]["proxy_us_per_stmt"], b["targets"]["lokadb"]["proxy_us_per_stmt"]
                parts.append(f"{qm} {pa:.1f} → {pb:.1f} µs ({pb / pa:.2f}×)")
        if parts:
            L.append(f"**The proxy's own cost per statement** (route, {ROUTE_RATE:,} statements/s at every N, so the "
                     f"same batching), {s['base']} → {top:,} organizations: " + "; ".join(parts) + ".\n")
    L.append("## Goals (issue 6)\n")
    for g in s["goals"]:
        L.append(f"- {g['what']}: {fmt(g['value'], 3)} (goal {g['goal']}): "
                 + ("**met**" if g["met"] else "**not met**" if g["met"] is not None else "— (no measurement)"))
    if s.get("direct_first_ratio") is not None:
        L.append(f"- for comparison, straight at the cloud, first statement at {max(s['orgs'])} ÷ at {s['base']}: "
                 f"{s['direct_first_ratio']:.2f}")
    L.append("")
    obs = checks(raw, s)
    L.append("## Automatic checks\n")
    L += [f"- {o}" for o in obs] if obs else ["- nothing flagged (proxy CPU per statement flat within 10 %, per "
                                              "connection within 30 %, no failed run, fidelity identical)."]
    L.append("")
    if m["errors"]:
        L.append("## Errors\n")
        L += [f"- {e[:1500]}" for e in m["errors"]]
        L.append("")
    L.append("Every run (command, tps, latencies, CPU, load average), the worlds' counts, the fidelity signatures and "
             "the planner probes: `raw.json.gz`. Method: `research/bench/README.md`, \"Organizations benchmark\".\n")
    return "\n".join(L)


COLORS = {"simple": "#1f6feb", "extended": "#d29922", "prepared": "#2da44e"}
MARKERS = {"read": "o", "update": "s", "insert": "^", "route": "D"}


def _xaxis(ax, Ns, title):
    ax.set_xscale("log")
    ax.set_xticks(Ns)
    ax.set_xticklabels([f"{n:,}" for n in Ns], fontsize=8)
    ax.minorticks_off()
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("organizations")


# The reference's throughput through LokaDB by the number of organizations, 32 clients, ops/s
# (shared/seed/performance-reference.txt, "Thousands of organizations"; at 3000 ÷ at 1: read
# 0.52, update 0.72, insert 0.16 as RESULTS.md's overview, row "Organizations", gives them),
# drawn ÷ its figure at 1.
REFERENCE_OPS = {"read": {1: 24371, 100: 23984, 1000: 12596, 3000: 12606},
                 "update": {1: 22209, 100: 25194, 1000: 17853, 3000: 15908},
                 "insert": {1: 8952, 100: 7846, 1000: 4961, 3000: 1432}}
# The reference's first statement after connecting: 1.6 ms with one organization, 14.8 ms with
# 3000 (the same section; RESULTS.md's overview: 9 ×), drawn as that factor over LokaDB's p50 at 1.
REFERENCE_FIRST_MS = {1: 1.6, 3000: 14.8}
# The goals (issue 6; RESULTS.md's overview, rows "Organizations"): throughput at 3000 ≥ 0.9 × at
# 1, the first statement after connecting at 3000 ≤ 2 × at 1.
GOAL_OVER_BASE = 0.9
GOAL_FIRST_OVER_BASE = 2.0


def draw_charts(outdir: Path, raw: dict, s: dict) -> list[str]:
    Ns = s["orgs"]
    sfx = " (quick)" if raw["meta"]["mode"] == "quick" else ""
    top_scripts = [x for x in s["scripts"] if x != "route"][:3]
    fig, axes = plt.subplots(2, 4, figsize=(20, 9))
    for ax, script in zip(axes[0], top_scripts):
        for qm in s["query_modes"]:
            for t, ls in (("lokadb", "-"), ("direct", "--")):
                ys = [(cell_of(s, script, qm, n) or {}).get("targets", {}).get(t, {}).get("over_base") for n in Ns]
                ax.plot(Ns, ys, ls, marker="o", color=COLORS.get(qm, "k"),
                        label=f"{'LokaDB' if t == 'lokadb' else 'direct'} {qm}")
        ref = REFERENCE_OPS.get(script)
        if ref and s["base"] in ref:
            rn = [n for n in sorted(ref) if n <= max(Ns)]  # a quick run stops at 1000
            ax.plot(rn, [ref[n] / ref[s["base"]] for n in rn], color=REFERENCE_STYLE["colors"], ls="-.",
                    lw=REFERENCE_STYLE["linewidths"], marker="x",
                    label=f"reference: LokaDB, {ref[max(rn)] / ref[s['base']]:.2f} at {max(rn):,}")
        goal_line(ax, GOAL_OVER_BASE, f"≥ {GOAL_OVER_BASE:g} through LokaDB at {max(Ns):,}")
        _xaxis(ax, Ns, f"{SCRIPT_LABEL.get(script, script)}: tps at N ÷ at {s['base']}{sfx}")
        ax.set_ylabel(f"throughput at N ÷ at {s['base']} (tps ratio)")
        ax.set_ylim(0, max(1.3, ax.get_ylim()[1]))
        ax.legend(fontsize=7)
    ax = axes[0][3]
    if "route" in s["scripts"]:
        for qm in s["query_modes"]:
            for key, ls, lab in (("proxy_us_per_stmt", "-", "proxy CPU µs"), ("p50_ms", ":", "p50 ms × 10")):
                ys = []
                for n in Ns:
                    v = (cell_of(s, "route", qm, n) or {}).get("targets", {}).get("lokadb", {}).get(key)
                    ys.append(v * 10 if v is not None and key == "p50_ms" else v)
                ax.plot(Ns, ys, ls, marker="D", color=COLORS.get(qm, "k"), label=f"{lab}, {qm}")
        _xaxis(ax, Ns, f"route, {ROUTE_RATE:,}/s via LokaDB:\nproxy CPU µs, p50 ms × 10{sfx}")
        ax.set_ylabel("µs per statement; ms × 10")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    else:
        ax.axis("off")
    for ax in axes[0][len(top_scripts):3]:
        ax.axis("off")
    panels = [
        ("proxy_over_direct", None, "LokaDB ÷ direct (tps)", "throughput ÷ direct (tps ratio)"),
        ("targets", "proxy_us_per_stmt", "proxy CPU µs per statement", "µs per statement"),
        ("targets", "cloud_us_per_stmt", "cloud CPU µs per statement (LokaDB runs)", "µs per statement"),
    ]
    for ax, (key, sub, title, ylabel) in zip(axes[1][:3], panels):
        ax.set_ylabel(ylabel)
        for script in s["scripts"]:
            for qm in s["query_modes"]:
                ys = []
                for n in Ns:
                    c = cell_of(s, script, qm, n) or {}
                    ys.append(c.get(key) if sub is None else c.get("targets", {}).get("lokadb", {}).get(sub))
                ax.plot(Ns, ys, marker=MARKERS.get(script, "o"), color=COLORS.get(qm, "k"),
                        ls="--" if script == "route" else "-", label=f"{script} {qm}")
        _xaxis(ax, Ns, title + sfx)
        ax.set_ylim(bottom=0)
        if key == "proxy_over_direct" and ax.get_ylim()[1] > 3:
            ax.set_ylim(0, 3)  # direct prepared runs can collapse (cold backends): clip, say so
            ax.set_title(title + " — clipped at 3" + sfx, fontsize=10)
        ax.legend(fontsize=6, ncol=2)
    ax = axes[1][3]
    for t, color in (("direct", "#8b949e"), ("lokadb", "#1f6feb")):
        for key, ls in (("first_ms_p50", "-"), ("connect_ms_p50", ":")):
            ys = [s["first"].get(n, {}).get("targets", {}).get(t, {}).get(key) for n in Ns]
            ax.plot(Ns, ys, ls, marker="o", color=color,
                    label=f"{'LokaDB' if t == 'lokadb' else 'direct'} {'first statement' if key.startswith('first') else 'connect'}")
    base = s["first"].get(s["base"], {}).get("targets", {}).get("lokadb", {}).get("first_ms_p50")
    if base:
        ref_factor = REFERENCE_FIRST_MS[max(REFERENCE_FIRST_MS)] / REFERENCE_FIRST_MS[min(REFERENCE_FIRST_MS)]
        reference_line(ax, ref_factor * base,
                       f"first statement {ref_factor:.0f} × at 1\nwith {max(REFERENCE_FIRST_MS):,} "
                       f"(its {REFERENCE_FIRST_MS[min(REFERENCE_FIRST_MS)]:g} → "
                       f"{REFERENCE_FIRST_MS[max(REFERENCE_FIRST_MS)]:g} ms),\ndrawn × LokaDB's "
                       f"{base:.2f} ms at {s['base']}")
        goal_line(ax, GOAL_FIRST_OVER_BASE * base,
                  f"first statement ≤ {GOAL_FIRST_OVER_BASE:g} × at {s['base']}\n"
                  f"({GOAL_FIRST_OVER_BASE * base:.2f} ms)")
    _xaxis(ax, Ns, "a new connection: p50 ms" + sfx)
    ax.set_ylabel("p50, ms")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=6, loc="center right")
    fig.suptitle(f"Organizations: cost vs their number, 32 clients ({raw['meta']['mode']} mode, "
                 f"run {raw['meta']['run_id']})", fontsize=11)
    fig.tight_layout()
    save_png(fig, outdir / "orgs-scaling.png", 90)
    plt.close(fig)
    return ["orgs-scaling.png"]


def _grid(s, fn, nd=3) -> list[str]:
    Ns = s["orgs"]
    rows = ["| script | mode | " + " | ".join(f"N = {n:,}" for n in Ns) + " |", "|---|---|" + "---:|" * len(Ns)]
    for script in s["scripts"]:
        for qm in s["query_modes"]:
            rows.append(f"| {script} | {qm} | " + " | ".join(fn(cell_of(s, script, qm, n)) for n in Ns) + " |")
    return rows


def update_charts_data(raw: dict, s: dict, outdir: Path, charts: list[str]) -> None:
    m = raw["meta"]
    mode = m["mode"]
    layout = m["mode_settings"].get("layout", "partitioned")
    rel = f"results/{outdir.name}"
    Ns = s["orgs"]
    body = ["## Organizations: cost vs their number" + (", quick mode — indicative only" if mode == "quick" else "")
            + f" — layout `{layout}` (" + ("each organization with a partition of its own"
                                          if layout == "partitioned" else "organizations back in DEFAULT") + ")",
            "",
            f"Run `{outdir.name}` (folder `{rel}/`), commit `{m['git']['commit'][:12]}`"
            f"{' (dirty tree)' if m['git']['dirty'] else ''}, lokadb sha256 `{m['binaries']['lokadb']['sha256'][:12]}`, "
            f"{m['machine']['nproc']} cores, written by `research/bench/orgs.py` (`{m['command']}`), 32 clients, "
            f"{m['mode_settings']['seconds']} s per run, R = {m['mode_settings']['reps']}, medians. Chart: "
            + ", ".join(f"`{rel}/{c}`" for c in charts) + ".", ""]
    body += [f"### orgs-scaling.png, top row, first three — tps at N ÷ tps at {s['base']}, LokaDB / direct "
             "(route: fixed rate, not a throughput)", ""]
    body += _grid(s, lambda c: f"{fmt(c['targets']['lokadb']['over_base'], 3)} / "
                               f"{fmt(c['targets']['direct']['over_base'], 3)}" if c else "—")
    if "route" in s["scripts"]:
        body += ["", f"### top row, 4th — route at {ROUTE_RATE:,} statements/s through LokaDB: proxy CPU µs per "
                     "statement / p50 ms", ""]
        body.append("| mode | " + " | ".join(f"N = {n:,}" for n in Ns) + " |")
        body.append("|---|" + "---:|" * len(Ns))
        for qm in s["query_modes"]:
            vals = []
            for n in Ns:
                c = cell_of(s, "route", qm, n)
                vals.append(f"{fmt(c['targets']['lokadb']['proxy_us_per_stmt'], 1)} / "
                            f"{fmt(c['targets']['lokadb']['p50_ms'], 3)}" if c else "—")
            body.append(f"| {qm} | " + " | ".join(vals) + " |")
    body += ["", "### bottom row, 1st — LokaDB ÷ direct (tps LokaDB / direct)", ""]
    body += _grid(s, lambda c: f"{fmt(c['proxy_over_direct'], 3)} ({fmt(c['targets']['lokadb']['tps'], 0)} / "
                               f"{fmt(c['targets']['direct']['tps'], 0)})" if c else "—")
    body += ["", "### bottom row, 2nd — proxy CPU µs per statement", ""]
    body += _grid(s, lambda c: fmt(c["targets"]["lokadb"]["proxy_us_per_stmt"], 1) if c else "—")
    body += ["", "### bottom row, 3rd — cloud CPU µs per statement, LokaDB runs (direct runs)", ""]
    body += _grid(s, lambda c: f"{fmt(c['targets']['lokadb']['cloud_us_per_stmt'], 0)} "
                               f"({fmt(c['targets']['direct']['cloud_us_per_stmt'], 0)})" if c else "—")
    body += ["", "### bottom row, 4th — a new connection, p50 ms: connect / first statement / second statement", ""]
    body.append("| target | " + " | ".join(f"N = {n:,}" for n in Ns) + " |")
    body.append("|---|" + "---:|" * len(Ns))
    for t in TARGETS:
        vals = []
        for n in Ns:
            e = s["first"].get(n, {}).get("targets", {}).get(t)
            vals.append(f"{fmt(e['connect_ms_p50'], 2)} / {fmt(e['first_ms_p50'], 2)} / {fmt(e['second_ms_p50'], 2)}"
                        if e else "—")
        body.append(f"| {'LokaDB' if t == 'lokadb' else 'direct'} | " + " | ".join(vals) + " |")
    write_charts_section(f"orgs {mode}" + (f" {layout}" if layout == "partitioned" else ""),
                         "\n".join(body).rstrip("\n"))


def render(raw: dict, outdir: Path, charts_data: bool) -> str:
    s = summarize(raw)
    raw["summary"] = s
    return write_outputs(raw, s, outdir, charts_data, summary_markdown, draw_charts, update_charts_data)


# --------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N = 1 and 1000, 1 s runs, R = 1 (≈ 1.4 min)")
    ap.add_argument("--out", type=Path, help="result folder (default results/<UTC ts>-orgs[-quick]); "
                                             "a trial run: charts-data.md is left alone")
    ap.add_argument("--orgs", help="comma-separated numbers of organizations (default: quick 1,1000; full 1,100,1000,3000)")
    ap.add_argument("--seconds", type=int, help="seconds per pgbench run (default: quick 1, full 4)")
    ap.add_argument("--reps", type=int, help="repetitions R (default: quick 1, full 2)")
    ap.add_argument("--query-modes", help="comma-separated pgbench -M modes (default simple,extended,prepared)")
    ap.add_argument("--scripts", help=f"comma-separated scripts (default {','.join(SCRIPTS)})")
    ap.add_argument("--max-locks", type=int, help=f"the cloud's max_locks_per_transaction (default {MAX_LOCKS}; "
                                                  "Postgres's own default is 64)")
    ap.add_argument("--no-fidelity", action="store_true", help="skip the real move-org + move-back comparison")
    ap.add_argument("--no-statement-org", action="store_true",
                    help='the proxy with "statement_org": false (a trial: pair it with --no-charts-data)')
    ap.add_argument("--layout", choices=("folded", "partitioned"), default="folded",
                    help="the N organizations back in DEFAULT, as move-back leaves a small one (default), or each "
                         "with its own partition, as move-back --fold-max-rows 0 leaves them")
    ap.add_argument("--no-charts-data", action="store_true", help="leave charts-data.md alone")
    ap.add_argument("--render", type=Path, help="only rebuild summary.md, the chart and charts-data.md from this raw.json or raw.json.gz")
    args = ap.parse_args()
    if args.render:
        return rerender(args.render, render, not args.no_charts_data)
    preflight("orgs.py", (PG_BIN / "postgres", PG_BIN / "pgbench", LOKADB_BIN, AGENT_BIN), 'run scripts/setup.sh and build the binaries (see research/bench/README.md)')
    mode = Mode(args.quick)
    if args.orgs:
        mode.orgs = sorted({int(x) for x in args.orgs.split(",")})
    if args.seconds:
        mode.seconds = args.seconds
    if args.reps:
        mode.reps = args.reps
    if args.query_modes:
        mode.query_modes = [x for x in args.query_modes.split(",") if x]
    mode.fidelity = not args.no_fidelity
    mode.layout = args.layout
    mode.statement_org = not args.no_statement_org
    if args.max_locks:
        mode.max_locks = args.max_locks
    if args.scripts:
        mode.scripts = [x for x in args.scripts.split(",") if x]
    started, run_id, outdir = result_dir(args.out, "-orgs" + ("-partitioned" if mode.layout == "partitioned" else ""),
                                         mode.quick)
    raise_fd_limit()
    catch_signals()

    ctx = Ctx(mode)
    ctx.runs = []
    ctx.proxy = None
    meta = {"run_id": run_id, "mode": mode.name, "started_utc": started.isoformat(),
            "command": ("LOKADB_BENCH_TARGET=" + str(os.environ.get("LOKADB_BENCH_TARGET", "")) + " "
                        if os.environ.get("LOKADB_BENCH_TARGET") else "")
                       + ".venv/bin/python research/bench/orgs.py " + shlex.join(sys.argv[1:]),
            "env": {"LOKADB_BENCH_TARGET": os.environ.get("LOKADB_BENCH_TARGET")},
            "mode_settings": dict(vars(mode)), "machine": machine_info(), "git": git_info(),
            "binaries": {b.name: binary_info(b) for b in (LOKADB_BIN, AGENT_BIN)},
            "pgbench_version": subprocess.run([str(PG_BIN / "pgbench"), "--version"], capture_output=True,
                                              text=True).stdout.strip(),
            "postgres_settings": {"cloud": {**CLOUD_PG, "max_locks_per_transaction": str(mode.max_locks)},
                                  "fsync": "on (default)"},
            "data": {"total_rows_of_the_N_orgs": TOTAL_ROWS, "plain_orgs": PLAIN_ORGS, "plain_rows": PLAIN_ROWS,
                     "table": " ".join(TABLE_DDL.split()), "index": INDEX_DDL},
            "scripts": {k: {n: v.format(total=TOTAL_ROWS, n=n) for n in mode.orgs} for k, v in SCRIPT_TEXT.items()},
            "warm_script": WARM_SCRIPT,
            "first_statement_sql": READ_SQL,
            "proxy_log": PROXY_LOG,
            "client": {"driver": f"psycopg {psycopg.__version__}", "role": "app (SCRAM)", "sslmode": "disable"},
            "setup_commands": ctx.commands, "errors": ctx.errors}
    raw = {"meta": meta, "worlds": [], "fidelity": None, "runs": ctx.runs, "first_statements": [], "planner": []}
    t_start = time.time()
    rc = 0
    try:
        ctx.tmp = temp_dir("lokadb-orgs-bench-")
        log(f"mode={mode.name} N={mode.orgs} {mode.seconds} s runs R={mode.reps} modes={mode.query_modes} "
            f"binaries={BIN_DIR} out={outdir}")
        meta["postgres_version"] = start_cloud(ctx)
        if mode.fidelity:
            log("fidelity check: a real org add + move-org + move-back against the SQL of this script")
            raw["fidelity"] = fidelity_check(ctx)
            if not raw["fidelity"]["identical"]:
                ctx.errors.append("fidelity: the synthetic organization differs from a real move-org + move-back in "
                                  + ", ".join(sorted(raw["fidelity"]["differences"])))
        for n in mode.orgs:
            log(f"building the world of {n} organizations")
            raw["worlds"].append(build_world(ctx, n))
        ctx.proxy = start_proxy(ctx, None if mode.statement_org else {"statement_org": False})
        meta["proxy_config"] = ctx.proxy_config
        meta["proxy_port"] = ctx.proxy.port
        raw["proxy_metadata"] = wait_metadata(ctx)
        raw["proxy_rss_kib_start"] = rss_kib(ctx.proxy.pid)
        log(f"proxy pid {ctx.proxy.pid} on port {ctx.proxy.port}: "
            + ", ".join(f"{db} {d['organizations']} orgs in {d.get('load_ms')} ms"
                        for db, d in raw["proxy_metadata"].items()))
        log("warm-up: the proxy's pooled cloud backends open every partition (32 sessions, one at a time)")
        for n in mode.orgs:
            r = pgbench(ctx, phase="warmup", script="warm", qmode="simple", n=n, target="lokadb", transactions=1)
            if not r["ok"]:
                ctx.errors.append(f"warm-up of the pool N={n}: {r.get('error')} — {r.get('first_error', '')}")
        for rep in range(mode.reps):
            Ns = mode.orgs if rep % 2 == 0 else mode.orgs[::-1]
            log(f"repetition {rep + 1}/{mode.reps}, N order {Ns}")
            k = 0
            for script in mode.scripts:
                for qm in mode.query_modes:
                    for n in Ns:
                        order = TARGETS if (k + rep) % 2 == 0 else TARGETS[::-1]
                        k += 1
                        # route runs at a fixed rate: 3 s give enough statements for its CPU per statement
                        secs = min(mode.seconds, ROUTE_SECONDS) if script == "route" else mode.seconds
                        for t in order:
                            pgbench(ctx, phase="measure", script=script, qmode=qm, n=n, target=t,
                                    seconds=secs, rep=rep)
            (outdir / "raw.json").write_text(json.dumps(raw, indent=1, default=str))
        log("first statement after connecting")
        for n in mode.orgs:
            raw["first_statements"].append(first_statements(ctx, n))
        log("the cloud's planner")
        for n in mode.orgs:
            try:
                raw["planner"].append(planner(ctx, n))
            except Exception as e:  # noqa: BLE001
                ctx.errors.append(f"planner probe N={n}: {e!r}")
        raw["proxy_rss_kib_end"] = rss_kib(ctx.proxy.pid)
        raw["proxy_metadata_lines"] = metadata_lines(ctx)
        for r in ctx.runs:
            if r["phase"] == "measure" and r.get("error"):
                ctx.errors.append(f"{r['script']} {r['query_mode']} N={r['orgs']} via {r['target']} (rep {r['rep']}): "
                                  f"{r['error']} — {r.get('first_error', '')}")
                rc = 1
    except KeyboardInterrupt as e:
        ctx.errors.append(f"interrupted: {e}")
        rc = 130
    except Exception as e:  # noqa: BLE001
        rc = fatal(ctx.errors, e)
        if getattr(ctx, "cloud", None) is not None:
            raw.setdefault("log_tails", {})["cloud"] = ctx.cloud.log_tail()
    finally:
        ignore_signals()
        if ctx.proxy is not None:
            try:
                raw["proxy_stderr_tail"] = ANSI.sub("", ctx.proxy.stderr_path.read_text(errors="replace"))[-4000:]
            except OSError:
                pass
        if getattr(ctx, "cloud", None) is not None:
            raw["cloud_log_errors"] = [l for l in ctx.cloud.log_tail(200_000).splitlines()
                                       if re.search(r"\b(ERROR|FATAL|PANIC|WARNING)\b", l)][-40:]
        safe_cleanup()
        meta["wall_seconds"] = round(time.time() - t_start, 1)
        binaries_at_end(meta, ctx.errors, (LOKADB_BIN, AGENT_BIN))
        meta["loadavg_at_end"] = Path("/proc/loadavg").read_text().strip()
        (outdir / "raw.json").write_text(json.dumps(raw, indent=1, default=str))
        if any(r["phase"] == "measure" for r in ctx.runs):
            save_rendered(raw, outdir / "raw.json", render, not args.no_charts_data and not args.out)
        log(f"results in {outdir} ({meta['wall_seconds']} s)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
