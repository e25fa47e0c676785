#!/usr/bin/env python3
"""LokaDB migration benchmark: the application's schema changes once organizations have moved
(docs/migrations.md, issue 27).

    /work/main/.venv/bin/python research/bench/migrations.py [--quick] [--out DIR]

World: a cloud cluster and one organization cluster (PostgreSQL 18), a relay, one agent per
organization. The cloud's database `app` holds `notes` (id bigserial, organization_id text, body
text; ROWS rows per organization, owned by the application's role `app`), made a LokaDB table
(`lokadb enable notes`); organizations o1…oN are registered (`lokadb org add`, each its own
database in the organization cluster, behind its own agent) and moved one after another
(`lokadb move-org --profile fdw+direct`: the migrations go through dblink from the cloud either
way; the profile matters only to the data migration below), c0 stays in the cloud. The cloud cluster's database `plain`
holds the same table and rows without LokaDB: the baseline.

For each number of moved organizations (quick 0, 1, 10; full 0, 1, 10, 100) and each distance of
the organizations (0 and 40 ms RTT: the agents dial the relay through the project's latency link,
20 ms each way), REPS times: `ALTER TABLE notes ADD COLUMN cK int` then `CREATE INDEX notes_cK ON
notes (cK)`, each an autocommit transaction of the role `app`, through the proxy (database app)
and straight at `plain`; wall time at the client. Meanwhile a second client (through the proxy for
the LokaDB run, straight at `plain` for the baseline) reads and inserts c0's notes in a loop: the
longest of its statements that overlapped the migration is how long another organization waited.
After each migration, `settled` is when no prepared transaction is left in the organization
cluster (the proxy's resolver commits them after the cloud's COMMIT), and every moved
organization's table is checked to have the new column and index. Then, once per cell, a data
migration over every organization (issue 27, item 6): `UPDATE notes SET cK = 1` as one statement
through the proxy (the cloud updates DEFAULT, then each moved organization's foreign partition
through postgres_fdw), against one statement per organization (c0 and all of o1…oN, moved or
not) through the proxy on 8 connections at once (a moved organization's goes straight to its
database on the direct path), and the one statement straight at `plain`.

Writes raw.json, summary.md and migrations.png into research/bench/results/<UTC ts>-migrations
[-quick]/. Builds nothing ($LOKADB_BENCH_TARGET).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lib.binaries import AGENT_BIN, LINK_BIN, LOKADB_BIN, PG_BIN  # noqa: E402
from lib.charts import save_png  # noqa: E402
from lib.clusters import APP_PASSWORD, CLOUD_PG, ORG_PG, PgCluster, cluster_root, lokadb  # noqa: E402
from lib.procs import catch_signals, log, preflight, temp_dir  # noqa: E402
from lib.relay import Relay, make_certs, new_token, start_agent, start_link, stop_agents  # noqa: E402
from lib.results import Ctx, guarded_run, rerender, result_dir, run_meta, summary_to_charts_data  # noqa: E402
from lib.routing_world import AUTH_PASSWORD, start_proxy  # noqa: E402

import psycopg  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402  (lib set the Agg backend)

CLOUD_ORG = "c0"
TABLE_SQL = "CREATE TABLE notes (id bigserial PRIMARY KEY, organization_id text NOT NULL, body text)"


class Mode:
    def __init__(self, quick: bool):
        self.quick = quick
        self.name = "quick" if quick else "full"
        self.counts = [0, 1, 10] if quick else [0, 1, 10, 100]
        self.rtts_ms = [0.0, 40.0]
        self.reps = 3 if quick else 5
        self.rows = 500 if quick else 2000  # per organization


def org_ids(n: int) -> list[str]:
    return [f"o{i}" for i in range(1, n + 1)]


def load(c, orgs: list[str], rows: int) -> None:
    c.execute(TABLE_SQL)
    c.execute("INSERT INTO notes (organization_id, body) SELECT o, 'note ' || g "
              "FROM unnest(%s::text[]) o, generate_series(1, %s) g", ([CLOUD_ORG, *orgs], rows))
    c.execute("ALTER TABLE notes OWNER TO app")
    c.execute("VACUUM ANALYZE notes")


def build_world(ctx) -> dict:
    mode = ctx.mode
    n = max(mode.counts)
    orgs = org_ids(n)
    t0 = time.time()
    root = cluster_root(ctx.tmp / "world")
    ctx.org = org = PgCluster(root, "org", ctx.commands)
    # Each moved organization's migration holds one prepared transaction until the resolver
    # commits it; every organization's postgres_fdw, dblink (a migrating session's and the
    # resolver's, kept), direct-path and move sessions need connections, all in this one
    # cluster (3 per organization ran out at 100 once the resolver kept its own).
    org.create({**ORG_PG, "max_connections": str(5 * n + 50), "max_prepared_transactions": str(n + 10)})
    with org.conn() as c:
        c.execute(f"CREATE ROLE app LOGIN PASSWORD '{APP_PASSWORD}'")
        for o in orgs:
            c.execute(f"CREATE DATABASE {o} OWNER app")
    ctx.commands.append(f"(org) CREATE ROLE app LOGIN PASSWORD '***'; CREATE DATABASE o1…o{n} OWNER app")
    ctx.cloud = cloud = PgCluster(root, "cloud", ctx.commands)
    # No autovacuum in the cloud: a DDL statement that meets an autovacuum of its table waits
    # deadlock_timeout (1 s) until Postgres cancels it, and the other organization's inserts
    # start one at random in either database (seen: 1.45 s for one ADD COLUMN, every other
    # statement on the table queued behind it). That is Postgres's cost, with or without
    # LokaDB, not the migration's.
    cloud.create({**CLOUD_PG, "max_connections": "200", "autovacuum": "off"})
    with cloud.conn() as c:
        c.execute(f"CREATE ROLE app LOGIN PASSWORD '{APP_PASSWORD}'")
        c.execute("CREATE DATABASE app OWNER app")
        c.execute("CREATE DATABASE plain OWNER app")
        c.execute(f"CREATE ROLE lokadb_auth LOGIN SUPERUSER PASSWORD '{AUTH_PASSWORD}'")
    for db in ("app", "plain"):
        with cloud.conn(db) as c:
            load(c, orgs, mode.rows)
    ctx.commands.append(f"(cloud, databases app and plain) {TABLE_SQL}; {mode.rows} rows for each of "
                        f"{CLOUD_ORG}, o1…o{n}; ALTER TABLE notes OWNER TO app")
    # The relay knows every organization's token; each agent dials it (later through the link).
    ctx.certs = make_certs(ctx.tmp, ctx.commands)
    ctx.tokens = {o: new_token(o) for o in orgs}
    ctx.agent_log = open(ctx.tmp / "agent.stderr.log", "ab")
    ctx.relay = Relay(ctx.tmp, ctx.certs, {o: h for o, (_, h) in ctx.tokens.items()}, {}, ctx.commands,
                      tag="relay")
    start_agents(ctx, 0.0)
    dsn = cloud.dsn()
    lokadb(ctx, ["init"], dsn)
    lokadb(ctx, ["enable", "notes"], dsn)
    for o in orgs:
        lokadb(ctx, ["org", "add", o, "--via-relay", f"127.0.0.1:{ctx.relay.pg_port}", "--dbname", o,
                     "--user", "app", "--password", APP_PASSWORD], dsn)
    T = round(time.time() - t0, 1)
    log(f"  world ready in {T} s: {n} organizations registered, {mode.rows} notes each")
    return {"seconds": T, "organizations": n, "rows_per_org": mode.rows,
            "postgres": cloud.one("SELECT version()")}


def start_agents(ctx, rtt_ms: float) -> None:
    """Every organization's agent, dialing the relay straight (0 ms) or through a latency link."""
    if getattr(ctx, "agents", None):
        stop_agents(ctx.agents)
    if getattr(ctx, "link", None) is not None:
        ctx.link.stop()
        ctx.link = None
    port = ctx.relay.agents_port
    if rtt_ms > 0:
        ctx.link = start_link(port, rtt_ms / 2, ctx.tmp, ctx.commands)
        port = ctx.link.port
    ctx.agents = []
    for o, (token, _) in ctx.tokens.items():
        ctx.agents.append(start_agent(f"127.0.0.1:{port}", token, ctx.org.addr(), ctx.certs["ca"], {},
                                      ctx.agent_log, max_conns=20))
    ctx.commands.append(f"{len(ctx.agents)} agents: {AGENT_BIN} --relay 127.0.0.1:{port} --token <org's> "
                        f"--postgres {ctx.org.addr()} --ca ca.crt --max-conns 20")
    ctx.relay.wait_connected(len(ctx.agents), timeout=120)


def app_conn(port: int, dbname: str):
    return psycopg.connect(host="127.0.0.1", port=port, user="app", password=APP_PASSWORD, dbname=dbname,
                           sslmode="disable", autocommit=True, connect_timeout=30)


class Waiter:
    """Another organization's client: reads and inserts c0's notes in a loop, each statement's
    start and end kept."""

    def __init__(self, port: int, dbname: str):
        self.conn = app_conn(port, dbname)
        self.spans: list[tuple[float, float]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        i = 0
        while not self.stop.is_set():
            i += 1
            sql, args = (("SELECT body FROM notes WHERE organization_id = %s AND id = %s", (CLOUD_ORG, i % 500 + 1))
                         if i % 2 else ("INSERT INTO notes (organization_id, body) VALUES (%s, 'waiter')", (CLOUD_ORG,)))
            t = time.perf_counter()
            try:
                self.conn.execute(sql, args).fetchall() if i % 2 else self.conn.execute(sql, args)
            except psycopg.Error as e:
                if len(self.errors) < 5:
                    self.errors.append(f"{e.sqlstate}: {str(e).strip()[:200]}")
            self.spans.append((t, time.perf_counter()))
            time.sleep(0.002)

    def longest_within(self, a: float, b: float) -> float | None:
        """The longest statement (ms) that overlapped [a, b]."""
        d = [(e - s) * 1e3 for s, e in self.spans if e >= a and s <= b]
        return round(max(d), 1) if d else None

    def close(self):
        self.stop.set()
        self.thread.join(timeout=60)
        self.conn.close()


def prepared_left(ctx) -> int:
    with ctx.org.conn() as c:
        return c.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone()[0]


def migrate(ctx, conn, waiter: Waiter, sql: str, lokadb_side: bool) -> dict:
    t = time.perf_counter()
    conn.execute(sql)
    done = time.perf_counter()
    rec = {"ms": round((done - t) * 1e3, 1), "other_org_longest_ms": waiter.longest_within(t, done)}
    if lokadb_side:
        # The proxy's resolver commits the organizations' prepared transactions after the COMMIT.
        deadline = time.monotonic() + 300
        while prepared_left(ctx) and time.monotonic() < deadline:
            time.sleep(0.005)
        rec["settled_ms"] = round((time.perf_counter() - t) * 1e3, 1)
        rec["prepared_left"] = prepared_left(ctx)
    return rec


def check_orgs(ctx, moved: list[str], column: str, index: str) -> list[str]:
    """Moved organizations whose table lacks the column or the index."""
    missing = []
    for o in moved:
        with ctx.org.conn(o) as c:
            col = c.execute("SELECT count(*) FROM pg_attribute WHERE attrelid = 'public.notes'::regclass "
                            "AND attname = %s AND NOT attisdropped", (column,)).fetchone()[0]
            idx = c.execute("SELECT count(*) FROM pg_indexes WHERE schemaname = 'public' AND tablename = 'notes' "
                            "AND indexname = %s", (index,)).fetchone()[0]
        if col != 1 or idx != 1:
            missing.append(o)
    return missing


PER_ORG_CONNS = 8


# The one statement through postgres_fdw costs a round trip per moved row (quick run
# 20261206T184556Z: 42 ms per row at 40 ms); past this many seconds at that rate it is not run
# (the full run's 100 organizations of 2,000 rows 40 ms away would take over two hours).
ONE_STATEMENT_BUDGET_S = 300


def data_migration(ctx, col: str, proxy_c, plain_c, pool: list, moved_rows: int, rtt_ms: float) -> dict:
    """A data migration over every organization (issue 27, item 6): `UPDATE notes SET col = v`
    as one statement (through the proxy: the cloud updates DEFAULT and each moved organization's
    foreign partition through postgres_fdw, one after another), and as one statement per
    organization (`… WHERE organization_id = %s`, every organization with rows) sent through
    the proxy on PER_ORG_CONNS connections at once; plain: the one statement straight at
    `plain`."""
    orgs = [CLOUD_ORG, *org_ids(max(ctx.mode.counts))]
    rec = {}
    t = time.perf_counter()
    plain_c.execute(f"UPDATE notes SET {col} = 1")
    rec["plain_ms"] = round((time.perf_counter() - t) * 1e3, 1)
    if moved_rows * rtt_ms / 1e3 <= ONE_STATEMENT_BUDGET_S:
        t = time.perf_counter()
        proxy_c.execute(f"UPDATE notes SET {col} = 1")
        rec["one_statement_ms"] = round((time.perf_counter() - t) * 1e3, 1)
    else:
        rec["one_statement_ms"] = None
        rec["one_statement_skipped"] = (f"not run: {moved_rows} moved rows at a round trip of "
                                        f"{rtt_ms:g} ms each would take about "
                                        f"{round(moved_rows * rtt_ms / 1e3)} s")
    todo = list(orgs)
    lock = threading.Lock()
    errors: list[str] = []

    def worker(conn):
        while True:
            with lock:
                if not todo:
                    return
                o = todo.pop()
            try:
                conn.execute(f"UPDATE notes SET {col} = 2 WHERE organization_id = %s", (o,))
            except psycopg.Error as e:
                errors.append(f"{o}: {e.sqlstate}: {str(e).strip()[:200]}")
    t = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(c,)) for c in pool]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    rec["per_org_ms"] = round((time.perf_counter() - t) * 1e3, 1)
    rec["per_org_errors"] = errors[:5]
    # Every organization's rows have the per-organization value.
    rec["rows_not_updated"] = proxy_c.execute(
        f"SELECT count(*) FROM notes WHERE {col} IS DISTINCT FROM 2").fetchone()[0]
    return rec


def cell(ctx, moved: list[str], rtt_ms: float, k0: int) -> dict:
    mode = ctx.mode
    reps = []
    proxy_c = app_conn(ctx.proxy.port, "app")
    plain_c = app_conn(ctx.cloud.port, "plain")
    pool = [app_conn(ctx.proxy.port, "app") for _ in range(PER_ORG_CONNS)]
    try:
        for r in range(mode.reps):
            k = k0 + r
            col, idx = f"c{k}", f"notes_c{k}"
            rep = {"k": k}
            for side, conn, port, db in (("plain", plain_c, ctx.cloud.port, "plain"),
                                         ("lokadb", proxy_c, ctx.proxy.port, "app")):
                w = Waiter(port, db)
                time.sleep(0.05)
                try:
                    rep[side] = {
                        "add_column": migrate(ctx, conn, w, f"ALTER TABLE notes ADD COLUMN {col} int", side == "lokadb"),
                        "create_index": migrate(ctx, conn, w, f"CREATE INDEX {idx} ON notes ({col})", side == "lokadb"),
                    }
                    time.sleep(0.05)
                finally:
                    w.close()
                rep[side]["waiter_errors"] = w.errors
            rep["orgs_missing_change"] = check_orgs(ctx, moved, col, idx)
            if r == 0:
                # Once per cell: through postgres_fdw it costs a round trip per moved row.
                rep["data"] = data_migration(ctx, col, proxy_c, plain_c, pool,
                                             len(moved) * mode.rows, rtt_ms)
            reps.append(rep)
    finally:
        proxy_c.close()
        plain_c.close()
        for c in pool:
            c.close()

    def med(side, stmt, key):
        v = [x[side][stmt].get(key) for x in reps if x[side][stmt].get(key) is not None]
        return round(statistics.median(v), 1) if v else None

    rec = {"moved": len(moved), "rtt_ms": rtt_ms, "reps": reps}
    for stmt in ("add_column", "create_index"):
        p, lk = med("plain", stmt, "ms"), med("lokadb", stmt, "ms")
        rec[stmt] = {"plain_ms": p, "lokadb_ms": lk, "ratio": round(lk / p, 1) if p and lk else None,
                     "settled_ms": med("lokadb", stmt, "settled_ms"),
                     "other_org_longest_ms_plain": med("plain", stmt, "other_org_longest_ms"),
                     "other_org_longest_ms_lokadb": med("lokadb", stmt, "other_org_longest_ms")}
    d = reps[0]["data"]
    rec["data"] = d
    missing = sorted({o for x in reps for o in x["orgs_missing_change"]})
    rec["orgs_missing_change"] = missing
    a, i = rec["add_column"], rec["create_index"]
    log(f"  {len(moved):>3} moved, RTT {rtt_ms:g} ms: ADD COLUMN {a['lokadb_ms']} ms (plain {a['plain_ms']}, "
        f"×{a['ratio']}), CREATE INDEX {i['lokadb_ms']} ms (plain {i['plain_ms']}, ×{i['ratio']}); other org "
        f"waited up to {a['other_org_longest_ms_lokadb']} / {i['other_org_longest_ms_lokadb']} ms"
        + (f"; MISSING in {missing}" if missing else ""))
    log(f"      data migration over every organization: one statement {d['one_statement_ms']} ms, per "
        f"organization on {PER_ORG_CONNS} connections {d['per_org_ms']} ms (plain {d['plain_ms']} ms)"
        + (f"; {d['rows_not_updated']} rows NOT UPDATED" if d["rows_not_updated"] else ""))
    return rec


def summary(raw: dict) -> str:
    m = raw["meta"]
    L = [f"# Migrations with moved organizations ({m['mode']})", "",
         f"Command: `{m['command']}` (LOKADB_BENCH_TARGET={m['env']['LOKADB_BENCH_TARGET']}); "
         f"{m['mode_settings']['reps']} repetitions per cell (medians), {m['mode_settings']['rows']} notes per "
         f"organization; started {m['started_utc']}, load average at end {m.get('loadavg_at_end', '?')}.", "",
         "Times are at the client, autocommit, role `app`. plain: the same statement straight at a database "
         "without LokaDB in the same cluster. settled: until the organizations' prepared transactions are "
         "committed. other org waited: the longest read or insert of organization c0 that overlapped the "
         "migration (through the proxy; straight at plain for the baseline). first in session: the cell's "
         "first ADD COLUMN, on a new session (its connections to organizations opened, not reused; "
         "docs/migrations.md, \"Locks\").", "",
         "| moved orgs | RTT ms | statement | plain ms | LokaDB ms | ratio | first in session ms | settled ms | other org waited ms (plain / LokaDB) |",
         "|---|---|---|---|---|---|---|---|---|"]
    for c in raw["cells"]:
        for stmt, label in (("add_column", "ADD COLUMN"), ("create_index", "CREATE INDEX")):
            s = c[stmt]
            first = c["reps"][0]["lokadb"]["add_column"].get("ms") if stmt == "add_column" and c["reps"] else None
            first = "" if first is None else round(first, 1)
            L.append(f"| {c['moved']} | {c['rtt_ms']:g} | {label} | {s['plain_ms']} | {s['lokadb_ms']} | "
                     f"{s['ratio']} | {first} | {s['settled_ms']} | {s['other_org_longest_ms_plain']} / "
                     f"{s['other_org_longest_ms_lokadb']} |")
    n_orgs = max(m["mode_settings"]["counts"]) + 1
    per = m["mode_settings"]["rows"]
    L += ["", "Data migration over every organization (`UPDATE notes SET cK = v` after its ADD COLUMN, once per "
          "cell; issue 27, item 6): one statement through the proxy (the cloud updates DEFAULT, then each moved "
          "organization's foreign partition through postgres_fdw, row by row: the LokaDB row triggers on the "
          "partitions keep postgres_fdw from sending the UPDATE whole), against one statement per organization "
          f"(`… WHERE organization_id = $1`, all {n_orgs}) through the proxy on {PER_ORG_CONNS} connections at "
          "once (a moved organization's straight to its database on the direct path); plain: the one statement "
          f"straight at a database without LokaDB. {n_orgs * per} rows in all, {per} per organization.", "",
          "| moved orgs | RTT ms | rows moved | plain ms | one statement ms | per organization ms | one ÷ per org | rows not updated |",
          "|---|---|---|---|---|---|---|---|"]
    for c in raw["cells"]:
        d = c.get("data")
        if not d:
            continue
        one = d["one_statement_ms"]
        ratio = round(one / d["per_org_ms"], 1) if one is not None and d["per_org_ms"] else None
        L.append(f"| {c['moved']} | {c['rtt_ms']:g} | {c['moved'] * per} | {d['plain_ms']} | "
                 f"{one if one is not None else d.get('one_statement_skipped')} | {d['per_org_ms']} | "
                 f"{ratio} | {d['rows_not_updated']} |")
    bad = [c for c in raw["cells"] if c["orgs_missing_change"]]
    L += ["", "Every moved organization's table had each new column and index after its migration."
          if not bad else f"Organizations missing a change: {[(c['moved'], c['rtt_ms'], c['orgs_missing_change']) for c in bad]}",
          ""]
    if raw["meta"]["errors"]:
        L += ["Errors:", "", *[f"- {e}" for e in raw["meta"]["errors"]], ""]
    return "\n".join(L)


def chart(raw: dict, path: Path) -> None:
    """migrations.png: each statement's time at the client by moved organizations, and how long
    another organization waited. The reference has no migration figure and no goal is stated
    (RESULTS.md, "Migrations"): title and units only."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.3))
    for ax, stmt, label in ((axes[0], "add_column", "ALTER TABLE … ADD COLUMN"),
                            (axes[1], "create_index", "CREATE INDEX")):
        for rtt in sorted({c["rtt_ms"] for c in raw["cells"]}):
            cs = [c for c in raw["cells"] if c["rtt_ms"] == rtt]
            ax.plot([c["moved"] for c in cs], [c[stmt]["lokadb_ms"] for c in cs], marker="o",
                    label=f"LokaDB, orgs {rtt:g} ms away")
            ax.plot([c["moved"] for c in cs], [c[stmt]["other_org_longest_ms_lokadb"] for c in cs],
                    marker="x", linestyle=":", label=f"another org waited ({rtt:g} ms)")
        cs = [c for c in raw["cells"] if c["rtt_ms"] == 0]
        ax.plot([c["moved"] for c in cs], [c[stmt]["plain_ms"] for c in cs], marker="s", color="#8b949e",
                label="plain Postgres")
        ax.set_xscale("symlog", linthresh=1)
        ax.set_yscale("log")
        ax.set_xlabel("moved organizations")
        ax.set_ylabel("ms at the client (median)")
        ax.set_title(label)
        ax.legend(fontsize=7)
    m = raw["meta"]
    fig.suptitle(f"Schema migrations with moved organizations: time at the client and another organization's "
                 f"longest wait ({m['mode']} mode, run {m['run_id']})", fontsize=9)
    fig.tight_layout()
    save_png(fig, path, 110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="0, 1 and 10 moved organizations, 3 repetitions")
    ap.add_argument("--out", type=Path, help="result folder (default results/<UTC ts>-migrations[-quick])")
    ap.add_argument("--no-charts-data", action="store_true", help="with --render: leave charts-data.md alone")
    ap.add_argument("--render", type=Path, help="only rebuild summary.md, the chart and charts-data.md from this "
                                                "raw.json or raw.json.gz")
    args = ap.parse_args()
    if args.render:
        return rerender(args.render, render, not args.no_charts_data)
    preflight("migrations.py", (PG_BIN / "postgres", LOKADB_BIN, AGENT_BIN, LINK_BIN))
    mode = Mode(args.quick)
    started, run_id, outdir = result_dir(args.out, "-migrations", mode.quick)
    catch_signals()
    ctx = Ctx(mode)
    meta = run_meta("migrations.py", run_id, started, mode,
                    setup_commands=ctx.commands, errors=ctx.errors)
    raw = {"meta": meta, "world": None, "cells": []}
    ctx.relay = ctx.link = ctx.proxy = None
    ctx.agents = []

    def body():
        ctx.tmp = temp_dir("lokadb-migrations-bench-")
        log(f"mode={mode.name} counts={mode.counts} rtts={mode.rtts_ms} out={outdir}")
        raw["world"] = build_world(ctx)
        ctx.proxy = start_proxy(ctx, "migrations")
        moved: list[str] = []
        k = 0
        for count in mode.counts:
            # Move organizations (close by) until `count` are moved.
            start_agents(ctx, 0.0)
            t = time.time()
            for o in org_ids(count)[len(moved):]:
                lokadb(ctx, ["move-org", o, "--profile", "fdw+direct"], ctx.cloud.dsn(), timeout=900)
                moved.append(o)
            if count:
                log(f"  {count} organizations moved ({round(time.time() - t, 1)} s for the last ones)")
            for rtt in mode.rtts_ms:
                start_agents(ctx, rtt)
                raw["cells"].append(cell(ctx, moved, rtt, k))
                k += mode.reps
                (outdir / "raw.json").write_text(json.dumps(raw, indent=1, default=str))

    def stop():
        if ctx.proxy is not None:
            ctx.proxy.stop()
        stop_agents(ctx.agents)
        if ctx.link is not None:
            ctx.link.stop()
        if ctx.relay is not None:
            ctx.relay.stop()

    return guarded_run(ctx, raw, outdir, render, lambda rc: rc == 0 and not args.out, body,
                       before_cleanup=stop)


def render(raw: dict, outdir: Path, charts_data: bool) -> str:
    """summary.md, the chart and (for a whole run) the charts-data.md section."""
    md = summary(raw)
    (outdir / "summary.md").write_text(md)
    if raw["cells"]:
        chart(raw, outdir / "migrations.png")
        if charts_data:
            summary_to_charts_data(f"migrations {raw['meta']['mode']}", md)
    return md


if __name__ == "__main__":
    sys.exit(main())
