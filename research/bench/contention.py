#!/usr/bin/env python3
"""LokaDB contention benchmark: update-then-insert transactions of concurrent clients on one
moved organization, through fdw and fdw+direct: throughput, the share of transactions that moved
from the organization's database to the cloud, and the rate of serialization failures (40001).

    /work/main/.venv/bin/python research/bench/contention.py [--quick] [--out DIR] [--no-charts-data]

The world is routing.py's (organization 2 moved, its database behind the relay and its agent,
every statement it runs logged). For each profile and each key distribution — hot (5 documents)
and uniform (all of organization 2's) — C psycopg clients through the proxy each run, for T
seconds, `BEGIN; UPDATE documents SET title = … WHERE organization_id = 2 AND id = …; INSERT INTO
document_versions …; COMMIT` (routing.py's tx_update_insert). On fdw+direct the UPDATE runs in the
organization's database and the INSERT needs the cloud: the transaction moves there
(docs/routing.md, "Transactions"); each move rolls back the direct transaction, so the ROLLBACKs
the organization's database logged count the moves. A client that gets 40001 counts it and goes
on with the next transaction (what an application's retry does). Writes raw.json.gz and summary.md
into research/bench/results/<UTC ts>-contention[-quick]/, and (a run without --out) its section of
charts-data.md; --render RAW writes them again from a run's raw.json[.gz]. Builds nothing
($LOKADB_BENCH_TARGET).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lib.binaries import AGENT_BIN, LINK_BIN, LOKADB_BIN, PG_BIN  # noqa: E402
from lib.procs import catch_signals, log, preflight, temp_dir  # noqa: E402
from lib.relay import prepare_tunnel, start_tunnel, stop_tunnel  # noqa: E402
from lib.results import Ctx, guarded_run, rerender, result_dir, run_meta, summary_to_charts_data  # noqa: E402
from lib.routing_world import (  # noqa: E402
    INSERT_SQL, ORG, PROFILES, UPDATE_SQL, OrgLog, analyse, build_world, client, set_profile, start_proxy,
)

import psycopg  # noqa: E402


class Mode:
    def __init__(self, quick: bool):
        self.quick = quick
        self.name = "quick" if quick else "full"
        self.clients = 8 if quick else 50  # full: the reference's 50
        self.seconds = 5.0 if quick else 20.0
        self.rtt_ms = 0.0
        self.hot = 5  # documents in the hot set
        # routing.py's Mode fields its world and windows read
        self.rtts_ms = [0]
        self.n = 0
        self.warmup = 0


def cell(ctx, profile: str, dist: str) -> dict:
    mode = ctx.mode
    ids = ctx.ids2[: mode.hot] if dist == "hot" else ctx.ids2
    counts = {"committed": 0, "40001": 0, "other_errors": 0}
    examples: list[str] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + mode.seconds
    titles = iter(range(10**9))

    def worker(seed: int):
        rng = random.Random(seed)
        conn = client(ctx)
        try:
            while time.monotonic() < stop_at:
                d = rng.choice(ids)
                with lock:
                    title = f"contention {profile} {dist} {next(titles)}"
                try:
                    with conn.transaction():
                        conn.execute(UPDATE_SQL, (title, d))
                        conn.execute(INSERT_SQL, (d, "contention audit"))
                    key = "committed"
                except psycopg.Error as e:
                    key = "40001" if e.sqlstate == "40001" else "other_errors"
                    if key == "other_errors" and len(examples) < 5:
                        examples.append(f"{e.sqlstate}: {str(e).strip()[:200]}")
                    if conn.broken:
                        conn = client(ctx)
                with lock:
                    counts[key] += 1
        finally:
            conn.close()

    ctx.log.cut()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(mode.clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    time.sleep(0.3)
    org_log = analyse(ctx.log.cut(), 0.0, keep=None)
    tried = counts["committed"] + counts["40001"] + counts["other_errors"]
    moved = org_log["by_keyword"].get("ROLLBACK", 0) if profile == "fdw+direct" else 0
    # Each transaction runs one UPDATE: those the organization's database got straight from the
    # proxy started direct; the others started on the cloud (the proxy had learned their opener).
    direct_updates = sum(1 for x in org_log["lines"] if x["source"] == "direct" and x["kw"] == "UPDATE")
    org_log.pop("lines")
    rec = {"profile": profile, "dist": dist, "clients": mode.clients, "seconds": round(wall, 2), **counts,
           "transactions": tried, "tps": round(counts["committed"] / wall, 1),
           "rate_40001": round(counts["40001"] / tried, 4) if tried else None,
           "moved": moved, "moved_share": round(moved / tried, 3) if tried else None,
           "started_direct": direct_updates,
           "org_statements": dict(org_log["by_keyword"]), "error_examples": examples}
    log(f"  {profile:<10} {dist:<7} {rec['tps']:7.1f} tx/s, 40001 {counts['40001']}/{tried} "
        f"({100 * (rec['rate_40001'] or 0):.2f} %), other errors {counts['other_errors']}, "
        f"moved {moved} ({100 * (rec['moved_share'] or 0):.1f} %), started direct {direct_updates}")
    return rec


def summary(raw: dict) -> str:
    m = raw["meta"]
    L = [f"# Contention: update-then-insert under concurrent clients ({m['mode']})", "",
         f"Command: `{m['command']}` (LOKADB_BENCH_TARGET={m['env']['LOKADB_BENCH_TARGET']}); "
         f"{m['mode_settings']['clients']} clients, {m['mode_settings']['seconds']} s per cell, RTT 0; "
         f"started {m['started_utc']}, load average at end {m.get('loadavg_at_end', '?')}.", "",
         "| profile | keys | committed tx/s | 40001 | rate | other errors | started direct | moved to the cloud |",
         "|---|---|---|---|---|---|---|---|"]
    for c in raw["cells"]:
        L.append(f"| {c['profile']} | {c['dist']} | {c['tps']} | {c['40001']} of {c['transactions']} | "
                 f"{100 * (c['rate_40001'] or 0):.2f} % | {c['other_errors']} | "
                 f"{c.get('started_direct', '?')} | {c['moved']} ({100 * (c['moved_share'] or 0):.1f} %) |")
    L += ["", "started direct: UPDATEs the organization's database got from the proxy itself (one per "
          "transaction that began on the direct path); moved: ROLLBACKs of direct transactions it "
          "logged (one per move). A move teaches the proxy's core the transaction's opener: for 30 s "
          "transactions it opens start on the cloud (docs/routing.md). Each cell runs on a fresh proxy.",
          "The ratio to read is fdw+direct ÷ fdw in one run; the machine is shared and noisy.", ""]
    return "\n".join(L)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 clients, 5 s per cell (≈ 1 min with the world)")
    ap.add_argument("--out", type=Path, help="result folder (default results/<UTC ts>-contention[-quick])")
    ap.add_argument("--clients", type=int, help="concurrent clients (default 50, quick 8)")
    ap.add_argument("--hot", type=int, help="documents in the hot set (default 5)")
    ap.add_argument("--no-charts-data", action="store_true", help="leave charts-data.md alone")
    ap.add_argument("--render", type=Path, help="only rebuild summary.md and charts-data.md from this raw.json or raw.json.gz")
    args = ap.parse_args()
    if args.render:
        return rerender(args.render, render, not args.no_charts_data)
    for name in ("clients", "hot"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            sys.exit(f"--{name} {getattr(args, name)}: must be at least 1")
    preflight("contention.py", (PG_BIN / "postgres", LOKADB_BIN, AGENT_BIN, LINK_BIN))
    mode = Mode(args.quick)
    mode.clients = args.clients or mode.clients
    mode.hot = args.hot or mode.hot
    started, run_id, outdir = result_dir(args.out, "-contention", mode.quick)
    catch_signals()
    ctx = Ctx(mode)
    ctx.log = None
    meta = run_meta("contention.py", run_id, started, mode,
                    sql={"update": UPDATE_SQL, "insert": INSERT_SQL},
                    setup_commands=ctx.commands, errors=ctx.errors)
    raw = {"meta": meta, "world": None, "cells": []}
    ctx.relay = ctx.link = ctx.agent = ctx.proxy = None

    def body():
        ctx.tmp = temp_dir("lokadb-contention-bench-")
        prepare_tunnel(ctx, ORG)
        log(f"mode={mode.name} clients={mode.clients} seconds={mode.seconds} out={outdir}")
        raw["world"] = build_world(ctx)
        ctx.log = OrgLog(ctx.org)
        start_tunnel(ctx, ORG, "relay-contention", mode.rtt_ms)
        ctx.proxy = start_proxy(ctx, "contention")
        for profile in PROFILES:
            set_profile(ctx, profile)
            for dist in ("hot", "uniform"):
                # A fresh proxy per cell: what one cell taught the proxy does not carry over.
                ctx.proxy.stop()
                ctx.proxy = None
                ctx.proxy = start_proxy(ctx, "contention")
                raw["cells"].append(cell(ctx, profile, dist))
                (outdir / "raw.json").write_text(json.dumps(raw, indent=1, default=str))

    def stop():
        stop_tunnel(ctx)
        if ctx.log is not None:
            ctx.log.close()

    return guarded_run(ctx, raw, outdir, render, lambda rc: rc == 0 and not args.out and not args.no_charts_data,
                       body, before_cleanup=stop)


def render(raw: dict, outdir: Path, charts_data: bool) -> str:
    """summary.md and, if charts_data and a cell was measured, the charts-data.md section: from the
    raw numbers alone (a run's end and --render)."""
    md = summary(raw)
    (outdir / "summary.md").write_text(md)
    if raw["cells"] and charts_data:
        hot = raw["meta"].get("mode_settings", {}).get("hot", 5)
        summary_to_charts_data(f"contention {raw['meta']['mode']}" + (f" hot {hot}" if hot != 5 else ""), md)
    return md


if __name__ == "__main__":
    sys.exit(main())
