#!/usr/bin/env python3
"""LokaDB benchmark of the other paths: COPY out of a query, COPY in, a cursor, LISTEN/NOTIFY.

    /work/main/.venv/bin/python research/bench/paths.py [--quick] [--out DIR] [--rtts MS,...]

The world of routing.py (research/bench/README.md, "Routing benchmark"): a cloud cluster with
the test schema, organization 1 in the cloud and organization 2 moved to its own database behind
the relay, a latency link (RTT/2 each way) in front of the relay's agent port, the agent, and the
proxy. For each RTT (quick 0, full 0 and 10 ms) and each target, one psycopg client (autocommit)
runs, in this order, each operation once unmeasured (not COPY in), then R times (quick 2, full 3),
and keeps the median:

  copy_out   COPY (SELECT id, organization_id, document_id FROM document_versions WHERE
             organization_id = O) TO STDOUT — N rows (quick 30,000, full 300,000)
  copy_in    COPY documents (organization_id, project_id, title) FROM STDIN — 10,000 rows at
             RTT 0 (quick 2,000), 1,000 at RTT > 0 (every row is a round trip to the
             organization on fdw); deleted again after each repetition, outside the timing
  cursor     BEGIN; DECLARE CURSOR for the copy_out query; FETCH 1000 until done; COMMIT
  notify     LISTEN on one connection, NOTIFY from another, 50 times: latency until the
             listener has it (no LokaDB table: the proxy's own cost)

Targets: `cloud` (straight at the cloud, organization 1), `proxy` (through LokaDB, organization
1), `cloud-fdw` (straight at the cloud, organization 2 on fdw: what postgres_fdw alone costs),
`proxy-fdw` and `proxy-fdw+direct` (through LokaDB, organization 2 with that profile).
Ratios are taken within one run: through the proxy ÷ straight at the cloud for the same
organization and profile.

Writes raw.json.gz and summary.md into research/bench/results/<UTC ts>-paths[-quick]/ (no
charts-data.md section); --render RAW writes summary.md again from a run's raw.json[.gz].
Benchmarks whatever binaries are in $LOKADB_BENCH_TARGET (default /work/target-bench/release);
builds nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lib import routing_world  # noqa: E402  (its world: clusters, schema, move-org, the proxy)
from lib.binaries import AGENT_BIN, LINK_BIN, LOKADB_BIN, PG_BIN, binary_info  # noqa: E402
from lib.clusters import SUPER_PASSWORD  # noqa: E402
from lib.numbers import fmt  # noqa: E402
from lib.procs import catch_signals, loadavg, log, preflight, temp_dir  # noqa: E402
from lib.relay import prepare_tunnel, start_tunnel, stop_tunnel  # noqa: E402
from lib.results import Ctx, guarded_run, parse_rtts, rerender, result_dir, run_meta, run_rounds  # noqa: E402

import psycopg  # noqa: E402

ORG, OTHER = routing_world.ORG, routing_world.OTHER
TARGETS = ["cloud", "proxy", "cloud-fdw", "proxy-fdw", "proxy-fdw+direct"]
OPS = ["copy_out", "copy_in", "cursor", "notify"]


class Mode:
    def __init__(self, quick: bool):
        self.quick = quick
        self.name = "quick" if quick else "full"
        self.rtts_ms = [0] if quick else [0, 10]
        self.pairs = 30_000 if quick else 300_000
        self.reps = 2 if quick else 3
        self.notifies = 50
        # COPY in's rows at RTT 0 (1,000 at RTT > 0): on fdw every row is a round trip, and
        # deleting them again after each repetition takes twice as long again.
        self.copy_in_rows = 2_000 if quick else 10_000


def org_of(target: str) -> str:
    return OTHER if target in ("cloud", "proxy") else ORG


def connect(ctx, target: str):
    """As routing.py's client: role postgres (SCRAM), straight at the cloud or through the proxy."""
    port = ctx.cloud.port if target.startswith("cloud") else ctx.proxy.port
    return psycopg.connect(host="127.0.0.1", port=port, user="postgres", password=SUPER_PASSWORD, dbname="app",
                           sslmode="disable", autocommit=True, connect_timeout=30)


def copy_out(c, org: str) -> dict:
    t = time.perf_counter()
    rows = 0
    with c.cursor().copy(f"COPY (SELECT id, organization_id, document_id FROM document_versions "
                         f"WHERE organization_id = {org}) TO STDOUT") as cp:
        for data in cp:
            rows += bytes(data).count(b"\n")
    return {"s": time.perf_counter() - t, "rows": rows}


def copy_in(c, org: str, n: int, tag: str) -> dict:
    project = 10 * int(org)
    data = "".join(f"{org}\t{project}\tpaths {tag} {i}\n" for i in range(n)).encode()
    t = time.perf_counter()
    with c.cursor().copy("COPY documents (organization_id, project_id, title) FROM STDIN") as cp:
        cp.write(data)
    s = time.perf_counter() - t
    c.execute(f"DELETE FROM documents WHERE organization_id = {org} AND title LIKE %s", (f"paths {tag} %",))
    return {"s": s, "rows": n}


def cursor(c, org: str) -> dict:
    t = time.perf_counter()
    rows, fetches = 0, []
    with c.transaction():
        c.execute(f"DECLARE paths_c CURSOR FOR SELECT id, organization_id, document_id FROM document_versions "
                  f"WHERE organization_id = {org}")
        while True:
            f0 = time.perf_counter()
            got = c.execute("FETCH 1000 FROM paths_c").fetchall()
            fetches.append((time.perf_counter() - f0) * 1e3)
            rows += len(got)
            if not got:
                break
    return {"s": time.perf_counter() - t, "rows": rows, "fetch_ms_p50": statistics.median(fetches)}


def notify(ctx, target: str, n: int) -> dict:
    listener, sender = connect(ctx, target), connect(ctx, target)
    try:
        listener.execute("LISTEN paths_bench")
        lat = []
        for i in range(n):
            t = time.perf_counter()
            # The NOTIFY's own round trip is in the latency: it is delivered at its commit.
            sender.execute(f"NOTIFY paths_bench, '{i}'")
            got = [x for x in listener.notifies(timeout=10, stop_after=1) if x.payload == str(i)]
            if not got:
                raise RuntimeError(f"notification {i} did not arrive within 10 s")
            lat.append((time.perf_counter() - t) * 1e3)
        lat.sort()
        return {"p50_ms": round(statistics.median(lat), 3), "p99_ms": round(lat[int(len(lat) * 0.99) - 1], 3),
                "n": n}
    finally:
        listener.close()
        sender.close()


def set_profile(ctx, target: str) -> None:
    if target.endswith("fdw+direct"):
        routing_world.set_profile(ctx, "fdw+direct")
    elif target.endswith("fdw"):
        routing_world.set_profile(ctx, "fdw")


def measure_target(ctx, rtt: float, target: str) -> dict:
    mode = ctx.mode
    set_profile(ctx, target)
    org = org_of(target)
    n_in = mode.copy_in_rows if rtt == 0 else 1_000
    rec = {"target": target, "org": org, "copy_in_rows": n_in}
    c = connect(ctx, target)
    try:
        c.execute("SELECT 1")
        for op in OPS:
            # One run unmeasured first (postgres_fdw's connection, plans, caches), except
            # COPY in, whose rows would only add up.
            if op == "copy_out":
                copy_out(c, org)
            elif op == "cursor":
                cursor(c, org)
            elif op == "notify":
                notify(ctx, target, 5)
            runs = []
            for r in range(mode.reps):
                if op == "copy_out":
                    runs.append(copy_out(c, org))
                elif op == "copy_in":
                    runs.append(copy_in(c, org, n_in, f"{target}-{rtt:g}-{r}"))
                elif op == "cursor":
                    runs.append(cursor(c, org))
                else:
                    runs.append(notify(ctx, target, mode.notifies))
            if op == "notify":
                rec[op] = {"p50_ms": statistics.median(x["p50_ms"] for x in runs),
                           "p99_ms": statistics.median(x["p99_ms"] for x in runs), "runs": runs}
            else:
                rec[op] = {"s": round(statistics.median(x["s"] for x in runs), 4),
                           "rows": runs[0]["rows"], "runs": runs}
            log(f"    RTT {rtt:g} {target:<17} {op:<8} "
                + (f"p50 {rec[op]['p50_ms']:.2f} ms p99 {rec[op]['p99_ms']:.2f} ms" if op == "notify"
                   else f"{rec[op]['rows']:>7} rows in {rec[op]['s'] * 1e3:9.1f} ms"))
    finally:
        c.close()
    return rec


def rtt_round(ctx, rtt: float) -> dict:
    rec = {"rtt_ms": rtt, "targets": [], "errors": []}
    ctx.relay = ctx.link = ctx.agent = ctx.proxy = None
    try:
        start_tunnel(ctx, ORG, f"relay-rtt{rtt:g}", rtt)
        rec["relay_select1_ms"] = routing_world.relay_rtt_ms(ctx)
        ctx.proxy = routing_world.start_proxy(ctx, f"rtt{rtt:g}")
        log(f"  RTT {rtt:g} ms: SELECT 1 through relay + link {rec['relay_select1_ms']} ms, proxy on port "
            f"{ctx.proxy.port} (load average {loadavg()})")
        for target in TARGETS:
            try:
                rec["targets"].append(measure_target(ctx, rtt, target))
            except Exception as e:  # noqa: BLE001
                rec["errors"].append(f"{target}: {e!r}")
                ctx.errors.append(f"RTT {rtt:g} {target}: {e!r}")
                log(f"    RTT {rtt:g} {target} FAILED: {e!r}")
                traceback.print_exc()
    finally:
        stop_tunnel(ctx, rec)
    return rec


RATIOS = [("proxy", "cloud", "through LokaDB ÷ straight, organization in the cloud"),
          ("proxy-fdw", "cloud-fdw", "through LokaDB ÷ straight, organization on fdw"),
          ("proxy-fdw+direct", "cloud-fdw", "through LokaDB on fdw+direct ÷ straight at the cloud on fdw"),
          ("proxy-fdw+direct", "cloud", "through LokaDB on fdw+direct ÷ straight at the cloud, organization in the cloud")]


def render(raw: dict, outdir: Path, charts_data: bool) -> str:
    """summary.md from the raw numbers alone (a run's end and --render); no charts-data.md section."""
    del charts_data
    meta = raw["meta"]
    L = [f"# Other paths ({meta['mode']}), run `{meta['run_id']}`", "",
         f"Command: `{meta['command']}`", "",
         "Medians of the repetitions; seconds for the whole operation, NOTIFY latency per notification.", ""]
    for rnd in raw["rounds"]:
        by = {t["target"]: t for t in rnd["targets"]}
        L += [f"## RTT {rnd['rtt_ms']:g} ms (SELECT 1 through relay + link: {rnd.get('relay_select1_ms')} ms)", "",
              "| target | org | COPY out (rows, ms) | COPY in (rows, ms) | cursor, FETCH 1000 (ms, p50 per FETCH) | NOTIFY p50 / p99 ms |",
              "|---|---|---:|---:|---:|---:|"]
        for t in TARGETS:
            r = by.get(t)
            if not r:
                L.append(f"| {t} | — | failed | | | |")
                continue
            L.append(f"| {t} | {r['org']} | {r['copy_out']['rows']:,} in {fmt(r['copy_out']['s'] * 1e3, 1)} | "
                     f"{r['copy_in']['rows']:,} in {fmt(r['copy_in']['s'] * 1e3, 1)} | "
                     f"{fmt(r['cursor']['s'] * 1e3, 1)} ({fmt(statistics.median(x['fetch_ms_p50'] for x in r['cursor']['runs']), 2)}) | "
                     f"{fmt(r['notify']['p50_ms'], 2)} / {fmt(r['notify']['p99_ms'], 2)} |")
        L += ["", "| ratio | COPY out | COPY in | cursor | NOTIFY p50 |", "|---|---:|---:|---:|---:|"]
        for a, b, label in RATIOS:
            if a in by and b in by:
                ra, rb = by[a], by[b]
                L.append(f"| {label} | {fmt(ra['copy_out']['s'] / rb['copy_out']['s'], 2)} | "
                         f"{fmt(ra['copy_in']['s'] / rb['copy_in']['s'], 2)} | "
                         f"{fmt(ra['cursor']['s'] / rb['cursor']['s'], 2)} | "
                         f"{fmt(ra['notify']['p50_ms'] / rb['notify']['p50_ms'], 2)} |")
        if rnd["errors"]:
            L += ["", "Errors: " + "; ".join(rnd["errors"])]
        L.append("")
    text = "\n".join(L)
    (outdir / "summary.md").write_text(text)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="RTT 0, 30,000 rows out and 2,000 in, 2 repetitions (≈ 25 s)")
    ap.add_argument("--out", type=Path, help="result folder (default results/<UTC ts>-paths[-quick])")
    ap.add_argument("--rtts", help="comma-separated RTTs in ms (default: quick 0, full 0,10)")
    ap.add_argument("--render", type=Path, help="only rebuild summary.md from this raw.json or raw.json.gz")
    args = ap.parse_args()
    if args.render:
        return rerender(args.render, render, False)
    preflight("paths.py", (PG_BIN / "postgres", LOKADB_BIN, AGENT_BIN, LINK_BIN))
    mode = Mode(args.quick)
    if args.rtts:
        mode.rtts_ms = parse_rtts(args.rtts, "0,10")
    started, run_id, outdir = result_dir(args.out, "-paths", mode.quick)
    catch_signals()
    ctx = Ctx(mode)
    meta = run_meta("paths.py", run_id, started, mode,
                    binaries={b.name: binary_info(b) for b in (LOKADB_BIN, AGENT_BIN, LINK_BIN)},
                    setup_commands=ctx.commands, errors=ctx.errors)
    raw = {"meta": meta, "world": None, "rounds": []}

    def body():
        ctx.tmp = temp_dir("lokadb-paths-bench-")
        prepare_tunnel(ctx, ORG)
        log(f"mode={mode.name} RTTs={mode.rtts_ms} ms rows={mode.pairs} out={outdir}")
        routing_world.PAIRS = mode.pairs
        raw["world"] = routing_world.build_world(ctx)
        # routing.py logs every statement of the organization's database; not here.
        with ctx.org.conn() as c:
            for k in routing_world.ORG_DB_SETTINGS:
                c.execute(f"ALTER DATABASE {routing_world.ORG_DB} RESET {k}")
        return run_rounds(ctx, raw, outdir, rtt_round)

    return guarded_run(ctx, raw, outdir, render, False, body,
                       binaries=(LOKADB_BIN, AGENT_BIN, LINK_BIN))


if __name__ == "__main__":
    sys.exit(main())
