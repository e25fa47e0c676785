#!/usr/bin/env python3
"""LokaDB failures benchmark: an organization's database stopped for 30 s, then its agent, under
the load of two other organizations (one in the cloud, one moved beside it); then 10, 100 and 200
extra agents connected to the relay; errors per organization and the others' latency.

    LOKADB_BENCH_TARGET=/work/main/target/release /work/main/.venv/bin/python research/bench/failures.py [--quick]

The routing benchmark's world (routing.build_world: a cloud cluster with the test schema,
organization 2 moved to its own database behind the relay and its agent, organization 1 in the
cloud), organization 2 on fdw+direct, no latency link, no statement logging; and organization 3,
PAIRS documents of its own added in the cloud, moved to a database of its own behind the same
relay with an agent of its own (`lokadb move-org 3 --profile fdw`: its reads and writes go through
the cloud's postgres_fdw, the path whose cloud backends also hold organization 2's connections).
C clients per organization (full 4, quick 2) through the proxy, psycopg, autocommit, each alternating a read of
one of its organization's documents and an update of one of its versions, 5 ms apart; a failed
operation is counted with its SQLSTATE and the client reconnects if its connection broke.
Timeline (full; quick halves every phase):

  baseline 10 s | organization 2's Postgres stopped 30 s (fast shutdown), started again on the
  same port | recovery 15 s | organization 2's agent stopped 30 s (SIGTERM), started again |
  recovery 15 s | 10, 100, 200 extra agents connected (of other organizations the relay knows,
  idle; each phase 15 s, counted once all are connected)

Per phase and organization: operations, failures (share, the three most frequent SQLSTATEs and
messages), p50 / p99 / max latency of those that succeeded; for organization 2, the seconds from
each restart to its first success again. Writes raw.json.gz and summary.md into
research/bench/results/<UTC ts>-failures[-quick]/. Builds nothing ($LOKADB_BENCH_TARGET).
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lib import routing_world  # noqa: E402  (its world: clusters, schema, move-org, the proxy)
from lib.binaries import AGENT_BIN, LINK_BIN, LOKADB_BIN, PG_BIN  # noqa: E402
from lib.clusters import (  # noqa: E402
    APP_PASSWORD, BODY_BYTES, ORG_DB, ORG_PG, SUPER_PASSWORD, PgCluster, cluster_root, lokadb, org_database,
)
from lib.numbers import percentile  # noqa: E402
from lib.procs import catch_signals, ignore_signals, log, preflight, rss_kib, safe_cleanup, temp_dir  # noqa: E402
from lib.relay import (  # noqa: E402
    Relay, new_token, prepare_tunnel, start_agent, start_link, stop_agents, stop_tunnel, tunnel_agent,
)
from lib.results import (  # noqa: E402
    Ctx, fatal, finish_run, rerender, result_dir, run_meta, summary_to_charts_data, write_raw_gz,
)
from lib.routing_world import ORG, OTHER, classify, org_pairs, read_sql, update_sql  # noqa: E402

import psycopg  # noqa: E402

NEIGHBOUR = "3"  # moved too (fdw), beside the one that fails
ORGS = (OTHER, ORG, NEIGHBOUR)  # "1" stays in the cloud, "2" is moved and fails, "3" is moved


class Mode:
    def __init__(self, quick: bool):
        self.quick = quick
        self.name = "quick" if quick else "full"
        self.clients = 2 if quick else 4
        k = 0.5 if quick else 1.0
        self.phases = [("baseline", 10 * k), ("database stopped", 30 * k), ("recovery", 15 * k),
                       ("agent stopped", 30 * k), ("recovery after the agent", 15 * k)]
        self.extra_agents = [10, 100, 200]
        self.phases += [(f"{n} extra agents", 15 * k) for n in self.extra_agents]
        # routing.py's Mode fields its world reads
        self.rtts_ms = [0]
        self.n = 0
        self.warmup = 0


def add_neighbour(ctx, token: str) -> dict:
    """Organization 3: PAIRS documents (one version each) written in the cloud through its triggers
    (key maps, foreign keys), a cluster of its own with its agent (ctx.neighbour_agent) on ctx's
    relay, `lokadb org add` and `lokadb move-org --profile fdw`. Returns what it did, and its
    (document id, version id) pairs under "pairs"."""
    t0 = time.time()
    ctx.neighbour = org = PgCluster(cluster_root(ctx.tmp / "world3"), "org3", ctx.commands)
    org.create(ORG_PG)
    org_database(org)
    n = NEIGHBOUR
    with ctx.cloud.conn("app") as c:
        c.execute(f"INSERT INTO organizations VALUES ({n}); INSERT INTO projects VALUES ({10 * int(n)}, {n})")
        c.execute(f"""INSERT INTO documents (organization_id, project_id, title)
                        SELECT {n}, {10 * int(n)}, 'bulk ' || g FROM generate_series(1, {routing_world.PAIRS}) g""")
        c.execute(f"""INSERT INTO document_versions (organization_id, document_id, body)
                        SELECT organization_id, id, left(repeat(md5(id::text), {BODY_BYTES // 32 + 1}), {BODY_BYTES})
                          FROM documents WHERE organization_id = {n}""")
    ctx.commands.append(f"(cloud, database app) organization {n}: {routing_world.PAIRS} documents and versions "
                        "as the bulk load's, through the triggers")
    ctx.neighbour_agent = start_agent(f"127.0.0.1:{ctx.relay.agents_port}", token, org.addr(), ctx.certs["ca"],
                                      {}, ctx.agent_log)
    ctx.relay.wait_connected(2, timeout=60)
    dsn = ctx.cloud.dsn()
    lokadb(ctx, ["org", "add", n, "--via-relay", f"127.0.0.1:{ctx.relay_pg_port}", "--dbname", ORG_DB,
                 "--user", "app", "--password", APP_PASSWORD], dsn)
    t = time.time()
    lokadb(ctx, ["move-org", n, "--profile", "fdw"], dsn, timeout=900)
    moved_s = round(time.time() - t, 1)
    with org.conn(ORG_DB) as c:
        docs = [r[0] for r in c.execute(f"SELECT id FROM documents WHERE organization_id = {n} ORDER BY id")]
        versions = [r[0] for r in c.execute(
            f"SELECT id FROM document_versions WHERE organization_id = {n} ORDER BY id")]
    log(f"  organization {n} moved (fdw) in {moved_s} s: {len(docs)} documents in its own database")
    return {"documents": len(docs), "move_org_s": moved_s, "total_s": round(time.time() - t0, 1),
            "pairs": list(zip(docs, versions))}


class Load:
    """The clients; each operation is appended to samples as (time, org, ok, latency ms, kind)."""

    def __init__(self, ctx, pairs: dict):
        self.ctx = ctx
        self.pairs = pairs
        self.samples: list[tuple] = []
        self.lock = threading.Lock()
        self.halt = threading.Event()
        self.threads = [threading.Thread(target=self.client, args=(org, i), daemon=True)
                        for org in ORGS for i in range(ctx.mode.clients)]

    def connect(self):
        return psycopg.connect(host="127.0.0.1", port=self.ctx.proxy.port, user="postgres",
                               password=SUPER_PASSWORD, dbname="app", sslmode="disable", autocommit=True,
                               connect_timeout=5, options="-c statement_timeout=10000")

    def client(self, org: str, i: int) -> None:
        # A slice of its organization's rows per client: two clients updating one row at once
        # would measure their own conflict (40001 through postgres_fdw's REPEATABLE READ), not
        # the failure's effect.
        per = len(self.pairs[org]) // self.ctx.mode.clients
        pairs = self.pairs[org][i * per:(i + 1) * per]
        conn = None
        n = 0
        while not self.halt.is_set():
            doc, version = pairs[n % len(pairs)]
            t = time.time()
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = self.connect()
                if n % 2 == 0:
                    ok = conn.execute(read_sql(org), (doc,)).fetchone() is not None
                else:
                    ok = conn.execute(update_sql(org), (f"client {i} op {n}", version)).rowcount == 1
                kind = "" if ok else "no row"
            except psycopg.Error as e:
                ok, kind = False, classify(e)
            with self.lock:
                self.samples.append((t, org, ok, (time.time() - t) * 1e3, kind))
            n += 1
            time.sleep(0.005)
        if conn is not None:
            conn.close()


def summarize(samples: list, marks: list) -> list[dict]:
    """Per phase (marks: (name, start, end)) and organization."""
    out = []
    for name, t0, t1 in marks:
        for org in ORGS:
            mine = [s for s in samples if s[1] == org and t0 <= s[0] < t1]
            lat = sorted(s[3] for s in mine if s[2])
            kinds = collections.Counter(s[4] for s in mine if not s[2])
            out.append({
                "phase": name, "org": org, "seconds": round(t1 - t0, 1), "operations": len(mine),
                "failed": sum(kinds.values()),
                "failed_share": round(sum(kinds.values()) / len(mine), 4) if mine else None,
                "kinds": kinds.most_common(3),
                "p50_ms": round(percentile(lat, 0.5), 2) if lat else None,
                "p99_ms": round(percentile(lat, 0.99), 2) if lat else None,
                "max_ms": round(lat[-1], 1) if lat else None,
            })
    return out


def first_success_after(samples: list, org: str, t: float):
    later = [s[0] for s in samples if s[1] == org and s[2] and s[0] >= t]
    return round(min(later) - t, 2) if later else None


def summary_markdown(raw: dict) -> str:
    m = raw["meta"]
    orgs = raw.get("orgs") or f"organization {OTHER} in the cloud, organization {ORG} moved (fdw+direct)."
    L = [f"# Failures under load ({m['mode']}), run `{m['run_id']}`", "",
         f"Command: `{m['command']}`; {m['mode_settings']['clients']} clients per organization through "
         f"the proxy, {orgs}", "",
         "| phase | org | operations | failed | p50 ms | p99 ms | max ms | failures, most frequent |",
         "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in raw.get("phases", []):
        share = f"{r['failed']} ({r['failed_share']:.1%})" if r["failed_share"] is not None else "–"
        kinds = "; ".join(f"{n} × {k}" for k, n in r["kinds"]) or "none"
        L.append(f"| {r['phase']} | {r['org']} | {r['operations']} | {share} | {r['p50_ms']} | {r['p99_ms']} | "
                 f"{r['max_ms']} | {kinds} |")
    rec = raw.get("recovery", {})
    L += ["", f"Organization {ORG}'s first success after its database started again: "
          f"{rec.get('database')} s; after its agent started again: {rec.get('agent')} s.", ""]
    for n, x in raw.get("extra_agents", {}).items():
        L.append(f"- {n} extra agents connected in {x['connected_in_s']} s; the relay's RSS then "
                 f"{x['relay_rss_kib'] / 1024:.1f} MiB.")
    L.append("")
    if m["errors"]:
        L += ["## Errors", ""] + [f"- {e[:800]}" for e in m["errors"]] + [""]
    return "\n".join(L)


def render(raw: dict, outdir: Path, charts_data: bool) -> str:
    md = summary_markdown(raw)
    (outdir / "summary.md").write_text(md)
    if charts_data:
        summary_to_charts_data(f"failures {raw['meta']['mode']}", md)
    return md


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="half-length phases, 2 clients per organization")
    ap.add_argument("--out", type=Path, help="result folder (default results/<UTC ts>-failures[-quick])")
    ap.add_argument("--no-charts-data", action="store_true", help="leave charts-data.md alone")
    ap.add_argument("--render", type=Path, help="only rebuild summary.md and charts-data.md from this raw.json or raw.json.gz")
    args = ap.parse_args()
    if args.render:
        return rerender(args.render, render, not args.no_charts_data)
    preflight("failures.py", (PG_BIN / "postgres", LOKADB_BIN, AGENT_BIN, LINK_BIN))
    mode = Mode(args.quick)
    started, run_id, outdir = result_dir(args.out, "-failures", mode.quick)
    catch_signals()
    routing_world.ORG_DB_SETTINGS = {}
    ctx = Ctx(mode)
    ctx.log = None
    meta = run_meta("failures.py", run_id, started, mode, setup_commands=ctx.commands, errors=ctx.errors)
    raw = {"meta": meta, "world": None, "phases": [], "recovery": {},
           "orgs": f"organization {OTHER} in the cloud, organization {ORG} moved (fdw+direct; its database "
                   f"and agent are the ones stopped), organization {NEIGHBOUR} moved (fdw) to a database of "
                   "its own behind the same relay, with an agent of its own."}
    t_start = time.time()
    rc = 0
    ctx.relay = ctx.link = ctx.agent = ctx.proxy = None
    load = None
    try:
        ctx.tmp = temp_dir("lokadb-failures-bench-")
        prepare_tunnel(ctx, ORG)
        raw["world"] = routing_world.build_world(ctx)
        pairs = org_pairs(ctx)
        # The relay knows the extra agents' organizations too (idle: no cloud organization is
        # theirs); organization 2's agent dials it through a link of 0 ms, as start_tunnel does.
        extra = [new_token(f"x{i}") for i in range(max(mode.extra_agents))]
        neighbour_token, neighbour_hash = new_token(NEIGHBOUR)
        tokens = {ORG: ctx.token_hash, NEIGHBOUR: neighbour_hash, **{t.split(".")[0]: h for t, h in extra}}
        ctx.relay = Relay(ctx.tmp, ctx.certs, tokens, {}, ctx.commands, agents_port=ctx.relay_agents_port,
                          postgres_port=ctx.relay_pg_port, tag="relay-failures")
        ctx.link = start_link(ctx.relay.agents_port, 0, ctx.tmp, ctx.commands)
        ctx.agent = tunnel_agent(ctx, ctx.link.port, ctx.org.addr())
        ctx.relay.wait_connected(1, timeout=60)
        ctx.extra = []
        raw["neighbour"] = add_neighbour(ctx, neighbour_token)
        pairs[NEIGHBOUR] = raw["neighbour"].pop("pairs")
        ctx.proxy = routing_world.start_proxy(ctx, "failures")
        routing_world.set_profile(ctx, "fdw+direct")
        load = Load(ctx, pairs)
        for t in load.threads:
            t.start()
        marks = []
        org_settings = dict(ctx.org.settings)
        for name, secs in mode.phases:
            if name.endswith("extra agents"):
                n = int(name.split()[0])
                began = time.monotonic()
                for token, _ in extra[len(ctx.extra):n]:
                    ctx.extra.append(start_agent(f"127.0.0.1:{ctx.relay.agents_port}", token, ctx.org.addr(),
                                                 ctx.certs["ca"], {}, ctx.agent_log))
                ctx.relay.wait_connected(n + 2, timeout=300)
                raw.setdefault("extra_agents", {})[n] = {
                    "connected_in_s": round(time.monotonic() - began, 2),
                    "relay_rss_kib": rss_kib(ctx.relay.proc.pid)}
            t0 = time.time()
            log(f"{name} ({secs:g} s)")
            if name == "database stopped":
                ctx.org.stop()
            elif name == "recovery":
                ctx.org.start(org_settings)
                raw["recovery"]["database_t"] = time.time()
            elif name == "agent stopped":
                stop_agents([ctx.agent])
                ctx.agent = None
            elif name == "recovery after the agent":
                ctx.agent = tunnel_agent(ctx, ctx.link.port, ctx.org.addr())
                raw["recovery"]["agent_t"] = time.time()
            time.sleep(max(0.0, secs - (time.time() - t0)))
            marks.append((name, t0, time.time()))
        load.halt.set()
        for t in load.threads:
            t.join(15)
        raw["phases"] = summarize(load.samples, marks)
        raw["recovery"]["database"] = first_success_after(load.samples, ORG, raw["recovery"]["database_t"])
        raw["recovery"]["agent"] = first_success_after(load.samples, ORG, raw["recovery"]["agent_t"])
        for r in raw["phases"]:
            log(f"  {r['phase']:<26} org {r['org']}: {r['operations']} ops, {r['failed']} failed, "
                f"p50 {r['p50_ms']} p99 {r['p99_ms']} max {r['max_ms']} ms")
    except KeyboardInterrupt as e:
        ctx.errors.append(f"interrupted: {e}")
        rc = 130
    except Exception as e:  # noqa: BLE001
        rc = fatal(ctx.errors, e)
        traceback.print_exc()
    finally:
        ignore_signals()
        if load is not None:
            load.halt.set()
        stop_agents(getattr(ctx, "extra", []) + [a for a in [getattr(ctx, "neighbour_agent", None)] if a])
        stop_tunnel(ctx, raw)
        safe_cleanup()
        finish_run(raw, outdir, t_start, render, rc == 0 and not args.out and not args.no_charts_data)
        write_raw_gz(outdir, raw)
    return rc


if __name__ == "__main__":
    sys.exit(main())
