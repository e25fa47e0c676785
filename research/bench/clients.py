#!/usr/bin/env python3
"""LokaDB many-clients benchmark, the ceilings by clients: 200, 500 and 1000 clients, the share of
their operations that failed.

    LOKADB_BENCH_TARGET=/work/target/release /work/main/.venv/bin/python research/bench/clients.py [--quick]
        [--clients 200,500,1000] [--setups KEY,...]

The routing benchmark's world (routing.build_world: a cloud cluster with the test schema, organization
2's database behind the relay and its agent, organization 2 moved with `lokadb move-org 2 --profile
fdw`, organization 1 left in the cloud), here with the cloud at max_connections 1200 and organization
2's database at Postgres's default 100, and no statement logging. For each client count (full 200,
500 and 1000; quick 1000), N clients connect, then each makes K operations (full 20, quick 6) on one
organization, back to back, autocommit, alternating a read of one document and an update of the
body of one of its versions (each client its own rows: no two clients wait on one row, up to the
world's rows, 3100 per organization; past them clients share rows, as the summary says). Six
set-ups, one after the other, each with fresh processes (no pooled backend or connection carried
over):

- `cloud, org in the cloud` and `lokadb, org in the cloud`: organization 1, straight at the cloud
  and through `lokadb proxy`;
- `cloud, fdw`: organization 2 straight at the cloud (the reference's set-up);
- `lokadb, fdw`: through the proxy, the organization on fdw;
- `lokadb, fdw+direct`: through the proxy, fdw+direct, `direct_pool` off (a session keeps its direct
  connection; past `direct_max` a session's statements go through the cloud);
- `lokadb, fdw+direct, direct_pool`: direct connections shared at the end of each transaction;
- `lokadb, fdw, pool_mode transaction`: the organization on fdw, cloud backends shared at the end of
  each transaction (`pool_size` 32): at most 32 cloud backends, so at most 32 postgres_fdw streams;
- `lokadb, org in the cloud, pool_mode transaction`: organization 1 through the proxy pooling by
  transaction (`pool_size` 32): the client counts past the cloud's max_connections (5000, 10000).

The proxy's max_connections is 1100, or the client count plus 100 past 1000 clients. Through the proxy, its resident
memory once every client connected, less at its start, ÷ the clients connected ("proxy KiB/client").

Per set-up: operations that failed ÷ attempted ("refused"), by SQLSTATE and message; clients that could
not connect (their K operations count as refused); wall time and operations per second; p50/p99 latency
of the operations that succeeded; the peak of connections to organization 2's database (sampled every
0.1 s); the proxy's CPU per operation.

Writes raw.json, summary.md and clients-refused.png into research/bench/results/<UTC ts>-clients[-quick]/
and the section "Many clients on one organization" of research/bench/charts-data.md. Builds nothing:
benchmarks the binaries in $LOKADB_BENCH_TARGET and records their sha256.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shlex
import sys
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lib import routing_world  # noqa: E402  (the world: clusters, schema, move-org; the proxy; the profile switch)
from lib.binaries import AGENT_BIN, BIN_DIR, LINK_BIN, LOKADB_BIN, PG_BIN, binary_info  # noqa: E402
from lib.charts import REFERENCE_STYLE, goal_line, marks, save_png  # noqa: E402
from lib.clusters import CLOUD_PG, ORG, ORG_DB, ORG_PG, SUPER_PASSWORD  # noqa: E402
from lib.numbers import fmt, percentile  # noqa: E402
from lib.procs import catch_signals, delta, log, preflight, raise_fd_limit, rss_kib, sched_ns, temp_dir  # noqa: E402
from lib.relay import prepare_tunnel, stop_agents, tunnel_agent, tunnel_relay  # noqa: E402
from lib.results import (  # noqa: E402
    Ctx, git_info, guarded_run, machine_info, rerender, result_dir, write_charts_section, write_empty_summary,
    write_outputs,
)
from lib.routing_world import CLOUD_ORG, classify, org_pairs, read_sql, update_sql  # noqa: E402

import psycopg  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402  (lib set the Agg backend)

CLIENT_APP = "lokadb-bench-many"
CLOUD_MAX_CONNECTIONS = "1200"
PROXY_MAX_CONNECTIONS = 1100


SETUPS = [  # (key, label, target, profile of organization 2 (None: left), direct_pool, org used)
    ("cloud_org", "cloud, org in the cloud", "cloud", None, False, CLOUD_ORG),
    ("lokadb_cloud_org", "lokadb, org in the cloud", "proxy", None, False, CLOUD_ORG),
    ("cloud", "cloud, fdw", "cloud", "fdw", False, ORG),
    ("lokadb_fdw", "lokadb, fdw", "proxy", "fdw", False, ORG),
    ("lokadb_direct", "lokadb, fdw+direct", "proxy", "fdw+direct", False, ORG),
    ("lokadb_direct_pool", "lokadb, fdw+direct, direct_pool", "proxy", "fdw+direct", True, ORG),
    ("lokadb_fdw_tx", "lokadb, fdw, pool_mode transaction", "proxy", "fdw", False, ORG),
    ("lokadb_cloud_tx", "lokadb, org in the cloud, pool_mode transaction", "proxy", None, False, CLOUD_ORG),
]
# Setups whose proxy pools cloud backends by transaction: their pool_size.
TX_POOL = {"lokadb_fdw_tx": 32, "lokadb_cloud_tx": 32}


class Mode:
    def __init__(self, quick: bool):
        self.quick = quick
        self.name = "quick" if quick else "full"
        self.client_counts = [1000] if quick else [200, 500, 1000]
        self.clients = max(self.client_counts)  # the rows needed: one pair per client
        self.ops = 6 if quick else 20  # per client
        self.connect_concurrency = 50


async def one_client(i: int, kw: dict, rows: tuple, ops: int, sem, start, rec: dict, org: str) -> None:
    doc, version = rows
    async with sem:
        try:
            conn = await psycopg.AsyncConnection.connect(**kw)
        except Exception as e:  # noqa: BLE001
            rec["connect_failed"][classify(e)] += 1
            return
    rec["connected"] += 1
    await start.wait()
    try:
        for n in range(ops):
            op = "read" if n % 2 == 0 else "update"
            t = time.perf_counter()
            try:
                if conn.closed or conn.broken:
                    conn = await psycopg.AsyncConnection.connect(**kw)
                if op == "read":
                    cur = await conn.execute(read_sql(org), (doc,))
                    good = await cur.fetchone() is not None
                else:
                    cur = await conn.execute(update_sql(org), (f"client {i} op {n}", version))
                    good = cur.rowcount == 1
                if good:
                    rec["ok"][op] += 1
                    rec["latency_ms"].append((time.perf_counter() - t) * 1e3)
                else:
                    rec["failed"][op]["wrong answer (no row)"] += 1
            except Exception as e:  # noqa: BLE001
                rec["failed"][op][classify(e)] += 1
    finally:
        try:
            await conn.close()
        except Exception:  # noqa: BLE001
            pass


async def many_clients(kw: dict, pairs: list, mode: Mode, rec: dict, clients: int, org: str) -> None:
    sem = asyncio.Semaphore(mode.connect_concurrency)
    start = asyncio.Event()
    tasks = [asyncio.create_task(one_client(i, kw, pairs[i % len(pairs)], mode.ops, sem, start, rec, org))
             for i in range(clients)]
    while rec["connected"] + sum(rec["connect_failed"].values()) < clients:
        await asyncio.sleep(0.05)
    rec["connect_s"] = round(time.time() - rec["t0"], 2)
    if rec.get("proxy_pid"):
        rec["proxy_rss_kib_connected"] = rss_kib(rec["proxy_pid"])
    rec["t_start"] = time.time()
    start.set()
    await asyncio.gather(*tasks)
    rec["ops_s"] = round(time.time() - rec["t_start"], 2)


class Sampler(threading.Thread):
    """The connections to organization 2's database, every 0.1 s (as its superuser, which has a
    reserved slot)."""

    def __init__(self, org):
        super().__init__(daemon=True)
        self.conn = org.conn(ORG_DB, application_name="lokadb-bench-sampler")
        self.conn.autocommit = True
        self.peak = 0
        self.halt = threading.Event()

    def count(self) -> int:
        return self.conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND backend_type = 'client backend' AND pid <> pg_backend_pid()").fetchone()[0]

    def run(self):
        while not self.halt.is_set():
            try:
                self.peak = max(self.peak, self.count())
            except psycopg.Error:
                pass
            time.sleep(0.1)

    def stop(self) -> int:
        self.halt.set()
        self.join(5)
        return self.peak


def wait_org_quiet(ctx, sampler: Sampler, timeout=60.0) -> int:
    t = time.time()
    n = sampler.count()
    while n > 0 and time.time() - t < timeout:
        time.sleep(0.2)
        n = sampler.count()
    return n


def one_setup(ctx, key: str, label: str, target: str, profile: str | None, pool: bool, org: str,
              clients: int) -> dict:
    mode = ctx.mode
    rec = {"key": key, "label": label, "target": target, "profile": profile, "direct_pool": pool,
           "org": org, "clients": clients,
           "ok": collections.Counter(), "failed": {"read": collections.Counter(), "update": collections.Counter()},
           "connect_failed": collections.Counter(), "connected": 0, "latency_ms": []}
    ctx.proxy = None
    sampler = Sampler(ctx.org)
    try:
        if profile is not None:
            routing_world.set_profile(ctx, profile)
        rec["org_connections_before"] = wait_org_quiet(ctx, sampler)
        if target == "proxy":
            db_extra = {"direct_pool": pool}
            if key in TX_POOL:
                db_extra.update(pool_mode="transaction", pool_size=TX_POOL[key])
            ctx.proxy = routing_world.start_proxy(
                ctx, key, db_extra=db_extra,
                extra={"max_connections": max(PROXY_MAX_CONNECTIONS, clients + 100)})
            port = ctx.proxy.port
            rec["proxy_pid"] = ctx.proxy.proc.pid
            rec["proxy_rss_kib_start"] = rss_kib(ctx.proxy.proc.pid)
            rec["proxy_config"] = ctx.proxy_config
        else:
            port = ctx.cloud.port
        kw = dict(host="127.0.0.1", port=port, user="postgres", password=SUPER_PASSWORD, dbname="app",
                  sslmode="disable", autocommit=True, connect_timeout=60, application_name=CLIENT_APP)
        cpu0 = sched_ns(ctx.proxy.proc.pid) if ctx.proxy else None
        sampler.start()
        rec["t0"] = time.time()
        asyncio.run(many_clients(kw, ctx.pairs[org], mode, rec, clients, org))
        rec["org_connections_peak"] = sampler.stop()
        if ctx.proxy:
            rec["proxy_cpu_ns"] = delta(cpu0, sched_ns(ctx.proxy.proc.pid))
            if ctx.proxy.proc.poll() is not None:
                raise RuntimeError(f"the proxy exited ({ctx.proxy.proc.returncode})")
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001
        rec["error"] = repr(e)
        rec["traceback"] = traceback.format_exc()
        ctx.errors.append(f"{label}: {e!r}")
        log(f"  {label} FAILED: {e!r}")
    finally:
        sampler.halt.set()
        if ctx.proxy is not None:
            ctx.proxy.stop()
            rec["proxy_stderr_tail"] = ctx.proxy.stderr_path.read_text(errors="replace")[-3000:]
        try:
            sampler.conn.close()
        except psycopg.Error:
            pass
    lat = sorted(rec.pop("latency_ms"))
    rec["p50_ms"] = round(percentile(lat, 0.5), 2) if lat else None
    rec["p99_ms"] = round(percentile(lat, 0.99), 2) if lat else None
    attempted = clients * mode.ops
    ok = sum(rec["ok"].values())
    rec["attempted"] = attempted
    rec["succeeded"] = ok
    rec["refused_pct"] = round(100.0 * (attempted - ok) / attempted, 2)
    rec["ops_per_s"] = round(ok / rec["ops_s"], 1) if rec.get("ops_s") else None
    if rec.get("proxy_rss_kib_connected") and rec["connected"]:
        rec["proxy_kib_per_client"] = round(
            (rec["proxy_rss_kib_connected"] - rec["proxy_rss_kib_start"]) / rec["connected"], 1)
    if rec.get("proxy_cpu_ns") and ok:
        rec["proxy_us_per_op"] = round(rec["proxy_cpu_ns"] / 1e3 / ok, 1)
    rec["ok"] = dict(rec["ok"])
    rec["failed"] = {op: dict(c) for op, c in rec["failed"].items()}
    rec["connect_failed"] = dict(rec["connect_failed"])
    log(f"  {label}: refused {rec['refused_pct']} % of {attempted} operations "
        f"({sum(rec['connect_failed'].values())} clients could not connect), "
        f"{rec['ops_per_s']} ops/s, p50 {rec['p50_ms']} ms, organization's connections at most "
        f"{rec.get('org_connections_peak')}")
    return rec


# --------------------------------------------------------------------------------------
# Summary


def summary_markdown(raw: dict, s: dict) -> str:
    m = raw["meta"]
    out = [f"# Many clients on one organization — run {m['run_id']}", "",
           f"`{m['command']}`, {', '.join(map(str, m['mode_settings']['client_counts']))} clients × "
           f"{m['mode_settings']['ops']} operations (alternately a read and an update of one organization's "
           f"rows, autocommit: organization {CLOUD_ORG} in the cloud, or organization {ORG}, moved), organization {ORG}'s "
           f"database at max_connections {m['postgres_settings']['org']['max_connections']}, the cloud at "
           f"{m['postgres_settings']['cloud']['max_connections']}; proxy defaults but max_connections "
           f"{PROXY_MAX_CONNECTIONS}, or the clients plus 100 past 1000 (direct_max 32)."
           + "".join(f" Organization {o}'s rows are fewer than the clients: up to {n} clients share a row."
                     for o, n in m.get("rows_shared", {}).items()), ""]
    out += ["| clients | set-up | refused | clients not connected | ops/s | p50 ms | p99 ms | org connections, peak | proxy µs/op | proxy KiB/client |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in raw["setups"]:
        out.append(f"| {r.get('clients', m['mode_settings']['clients'])} | {r['label']} | {r['refused_pct']} % | "
                   f"{sum(r['connect_failed'].values())} | "
                   f"{fmt(r.get('ops_per_s'), 0)} | {fmt(r.get('p50_ms'))} | {fmt(r.get('p99_ms'))} | "
                   f"{r.get('org_connections_peak', '–')} | {fmt(r.get('proxy_us_per_op'), 1)} | "
                   f"{fmt(r.get('proxy_kib_per_client'), 1)} |")
    out += ["", "## Failures by kind", ""]
    for r in raw["setups"]:
        who = f"{r['label']}, {r.get('clients', m['mode_settings']['clients'])} clients"
        kinds = collections.Counter()
        for op, c in r["failed"].items():
            for k, n in c.items():
                kinds[f"{op}: {k}"] += n
        for k, n in r["connect_failed"].items():
            kinds[f"connect: {k}"] += n
        out.append(f"- **{who}**: " + ("none" if not kinds else "; ".join(
            f"{n} × {k}" for k, n in kinds.most_common(6))))
        if r.get("error"):
            out.append(f"  - set-up error: {r['error']}")
    if m["errors"]:
        out += ["", "## Errors", ""] + [f"- {e[:1500]}" for e in m["errors"]]
    return "\n".join(out) + "\n"


# Operations failed on a moved organization through LokaDB on fdw, by clients: the reference's
# 0 / 0 / 82 % at 200 / 500 / 1000 (shared/seed/performance-reference.txt, "Ceilings by the number
# of clients"; RESULTS.md's overview, row "Clients"), drawn over the "lokadb, fdw" set-up. The
# goal: 0 % failed (the same row).
REFERENCE_SETUP = "lokadb_fdw"
REFERENCE_FAILED_PCT = {200: 0.0, 500: 0.0, 1000: 82.0}
GOAL_FAILED_PCT = 0.0


def draw_charts(outdir: Path, raw: dict, s: dict) -> list[str]:
    rows = raw["setups"]
    m = raw["meta"]["mode_settings"]
    counts = m.get("client_counts") or [m["clients"]]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(labels) + 2), 3.8))
    w = 0.8 / len(counts)
    shades = ["#9ecae1", "#4292c6", "#08519c", "#08306b"]
    ref_label = next((r["label"] for r in rows if r.get("key") == REFERENCE_SETUP), None)
    ref_drawn = False
    for i, n in enumerate(counts):
        vals = [next((r["refused_pct"] for r in rows
                      if r["label"] == lab and r.get("clients", m["clients"]) == n), None) for lab in labels]
        xs = [j + (i - (len(counts) - 1) / 2) * w for j in range(len(labels))]
        bars = ax.bar(xs, [v or 0 for v in vals], w, label=f"{n} clients", color=shades[i % len(shades)])
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, (v or 0) + 1, "–" if v is None else f"{v:g}",
                    ha="center", fontsize=7)
        if ref_label in labels and n in REFERENCE_FAILED_PCT:
            marks(ax, [xs[labels.index(ref_label)]], [REFERENCE_FAILED_PCT[n]], w,
                  "_" if ref_drawn else "reference (LokaDB, moved on fdw): "
                  + " / ".join(f"{v:g} %" for v in REFERENCE_FAILED_PCT.values())
                  + f" at {' / '.join(map(str, REFERENCE_FAILED_PCT))} clients", REFERENCE_STYLE)
            ref_drawn = True
    goal_line(ax, GOAL_FAILED_PCT, f"{GOAL_FAILED_PCT:g} % failed on a moved organization")
    ax.set_xticks(range(len(labels)), [lab.replace(", ", ",\n", 1) for lab in labels], fontsize=8)
    ax.set_ylim(-2, 128)
    ax.set_yticks(range(0, 101, 20))
    ax.set_ylabel("operations failed (% of attempted)")
    ax.legend(fontsize=7, loc="upper center", ncol=3)
    ax.set_title(f"Ceilings by clients: operations failed, per set-up and number of clients "
                 f"({raw['meta']['mode']} mode, run {raw['meta']['run_id']})", fontsize=10)
    fig.tight_layout()
    save_png(fig, outdir / "clients-refused.png", 110)
    plt.close(fig)
    return ["clients-refused.png"]


def update_charts_data(raw: dict, s: dict, outdir: Path, charts: list[str]) -> None:
    m = raw["meta"]
    rel = f"results/{outdir.name}"
    body = ["## Many clients on one organization" + (", quick mode — indicative only" if m["mode"] == "quick" else ""),
            "",
            f"Run `{outdir.name}` (folder `{rel}/`), commit `{m['git']['commit'][:12]}`"
            f"{' (dirty tree)' if m['git']['dirty'] else ''}, lokadb sha256 `{m['binaries']['lokadb']['sha256'][:12]}`, "
            f"{m['machine']['nproc']} cores, written by `research/bench/clients.py` (`{m['command'].strip()}`). "
            f"Charts: " + ", ".join(f"`{rel}/{c}`" for c in charts) + ".", "",
            "### clients-refused.png — operations refused (%), and what else each set-up did", "",
            "| clients | set-up | refused % | clients not connected | ops/s | p50 ms | org connections, peak |",
            "|---:|---|---:|---:|---:|---:|---:|"]
    for r in raw["setups"]:
        body.append(f"| {r.get('clients', m['mode_settings']['clients'])} | {r['label']} | {r['refused_pct']} | "
                    f"{sum(r['connect_failed'].values())} | "
                    f"{fmt(r.get('ops_per_s'), 0)} | {fmt(r.get('p50_ms'))} | {r.get('org_connections_peak', '–')} |")
    write_charts_section(f"clients {m['mode']}", "\n".join(body))


def render(raw: dict, outdir: Path, charts_data: bool) -> str:
    s = {}
    if not raw.get("setups"):
        return write_empty_summary(raw, outdir, "Many clients", "set-up")
    return write_outputs(raw, s, outdir, charts_data, summary_markdown, draw_charts, update_charts_data)


# --------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="6 operations per client instead of 20 (≈ 3 min)")
    ap.add_argument("--out", type=Path, help="result folder; a trial run: charts-data.md is left alone")
    ap.add_argument("--clients", help="comma-separated client counts (default 200,500,1000; quick 1000)")
    ap.add_argument("--setups", help="comma-separated subset of: " + ",".join(k for k, *_ in SETUPS))
    ap.add_argument("--no-charts-data", action="store_true", help="leave charts-data.md alone")
    ap.add_argument("--render", type=Path, help="only rebuild summary.md, the chart and charts-data.md from this raw.json or raw.json.gz")
    args = ap.parse_args()
    if args.render:
        return rerender(args.render, render, not args.no_charts_data)
    preflight("clients.py", (PG_BIN / "postgres", LOKADB_BIN, AGENT_BIN, LINK_BIN))
    mode = Mode(args.quick)
    if args.clients:
        try:
            mode.client_counts = [int(n) for n in args.clients.split(",")]
        except ValueError:
            sys.exit(f"--clients {args.clients!r}: write client counts separated by commas, e.g. 200,500")
        if not all(n > 0 for n in mode.client_counts):
            sys.exit(f"--clients {args.clients!r}: every count must be above 0")
        mode.clients = max(mode.client_counts)
    setups = SETUPS
    if args.setups:
        want = args.setups.split(",")
        setups = [s for s in SETUPS if s[0] in want]
    started, run_id, outdir = result_dir(args.out, "-clients", mode.quick)
    catch_signals()
    raise_fd_limit()
    # The routing world, with room in the cloud for every client and no statement logging.
    routing_world.CLOUD_PG = {**CLOUD_PG, "max_connections": CLOUD_MAX_CONNECTIONS}
    routing_world.ORG_DB_SETTINGS = {}
    ctx = Ctx(mode)
    meta = {"run_id": run_id, "mode": mode.name, "started_utc": started.isoformat(),
            "command": ("/work/main/.venv/bin/python research/bench/clients.py " + shlex.join(sys.argv[1:])).strip(),
            "env": {"LOKADB_BENCH_TARGET": os.environ.get("LOKADB_BENCH_TARGET")},
            "mode_settings": dict(vars(mode)), "machine": machine_info(), "git": git_info(),
            "binaries": {b.name: binary_info(b) for b in (LOKADB_BIN, AGENT_BIN, LINK_BIN)},
            "postgres_settings": {"cloud": routing_world.CLOUD_PG, "org": ORG_PG},
            "operations": {"read": read_sql("ORG"), "update": update_sql("ORG")},
            "setups": [{"key": k, "label": lab, "target": t, "profile": p, "direct_pool": pool, "org": o}
                       for k, lab, t, p, pool, o in setups],
            "setup_commands": ctx.commands, "errors": ctx.errors}
    raw = {"meta": meta, "world": None, "setups": []}

    def body():
        rc = 0
        ctx.tmp = temp_dir("lokadb-clients-bench-")
        prepare_tunnel(ctx, ORG)
        log(f"mode={mode.name} clients={mode.client_counts} ops={mode.ops} binaries={BIN_DIR} out={outdir}")
        log("building the world (cloud + organization clusters, move-org)")
        raw["world"] = routing_world.build_world(ctx)
        ctx.pairs = org_pairs(ctx)
        for org, pairs in ctx.pairs.items():
            if len(pairs) < mode.clients:
                # Past the world's rows, clients share them (client i takes pair i mod rows):
                # up to ⌈clients ÷ rows⌉ clients update one row, one after the other.
                shared = -(-mode.clients // len(pairs))
                raw["meta"].setdefault("rows_shared", {})[org] = shared
                log(f"organization {org}: {len(pairs)} rows for {mode.clients} clients: "
                    f"up to {shared} clients share a row")
        # The relay and the agent, no latency link: what is measured is connections, not distance.
        ctx.relay = tunnel_relay(ctx, ORG, "relay")
        ctx.agent = tunnel_agent(ctx, ctx.relay.agents_port, ctx.org.addr())
        ctx.relay.wait_connected(1, timeout=60)
        for clients in mode.client_counts:
            for key, label, target, profile, pool, org in setups:
                log(f"{label}: {clients} clients")
                r = one_setup(ctx, key, label, target, profile, pool, org, clients)
                raw["setups"].append(r)
                (outdir / "raw.json").write_text(json.dumps(raw, indent=1, default=str))
                if r.get("error"):
                    rc = 1
        return 1 if ctx.errors else rc

    def stop():
        if getattr(ctx, "agent", None) is not None:
            stop_agents([ctx.agent])
        if getattr(ctx, "relay", None) is not None:
            ctx.relay.stop()

    return guarded_run(ctx, raw, outdir, render, not args.no_charts_data and not args.out, body,
                       binaries=(LOKADB_BIN, AGENT_BIN, LINK_BIN),
                       before_cleanup=stop)

if __name__ == "__main__":
    sys.exit(main())
