#!/usr/bin/env python3
"""LokaDB overload benchmark, an open model: requests arrive at set rates whether or not the
earlier ones are answered, through LokaDB, through PgBouncer and straight at Postgres.

    /work/main/.venv/bin/python research/bench/overload.py [--quick] [--out DIR]

The world of run.py (one PostgreSQL 18 cluster, 200,000 documents; LokaDB with its defaults;
PgBouncer 1.18 in transaction mode, pool 32). For each of run.py's `read` and `update` scripts:

1. The scale: `pgbench -c 256 -j 2 -T S` straight at Postgres, closed loop (each client sends
   as soon as it is answered), the median of 3 runs (quick 1): C. (With 32 clients Postgres serves
   about twice as much here; 256 backends contend for 2 cores.)
2. R times (full 2, quick 1), for each offered rate (a share of C: full 0.5 to 1.3 by 0.1;
   quick 0.5 and 0.9), each target in turn (order rotated):
   `pgbench -c 256 -j 2 -T S -R RATE -L 1000 -l` — pgbench schedules transactions at RATE
   (Poisson arrivals) over 256 clients and measures each from its scheduled start, so waiting
   for a free client counts; a transaction already over 1 s late is skipped, one that
   finishes past 1 s is late. Both count as timeouts (the reference's 1 s timeout).

Per target and rate: transactions answered per second, p50 and p99 (of those answered, from the
per-transaction log), timeouts (skipped + late) ÷ offered. The knee of a target is the highest
offered rate it keeps up with, and every lower one: answered ≥ 0.95 × offered and timeouts ≤ 1 %.
Direct capacity is direct's knee (the most Postgres accepts in full at 256 workers); a proxy's
knee is reported as a share of it, per repetition (the reference: 0.9; goal ≥ 0.95). One run can
fall into a checkpoint or the machine's other load: the repetitions show how far to trust a knee.

Writes raw.json.gz, summary.md and a chart into research/bench/results/<UTC ts>-overload[-quick]/.
Benchmarks the binaries in $LOKADB_BENCH_TARGET (default target/release); builds nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib import three_targets as world  # noqa: E402  (run.py's world: Postgres, LokaDB, PgBouncer)
from lib.binaries import PG_BIN  # noqa: E402
from lib.charts import goal_line, reference_line, save_png  # noqa: E402
from lib.procs import catch_signals, log, preflight, raise_fd_limit  # noqa: E402
from lib.results import finish_run, read_raw, result_dir, run_meta, write_raw_gz, write_with_chart  # noqa: E402
from lib.three_targets import LOKADB_BIN, PGBOUNCER_BIN, PROXIES, TARGETS, binary_info, rotated  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402  (lib set the Agg backend)

SCRIPTS = ["read", "update"]
CLIENTS = 256
LIMIT_MS = 1000
KEEPS_UP = 0.95
MAX_TIMEOUTS = 0.01


class Mode(world.Mode):
    def __init__(self, quick: bool):
        super().__init__(quick)
        # Quick: two rates, 0.5 (everyone should keep up) and 0.9 (the reference's knee); runs
        # of 5 s, no shorter: straight at Postgres each run starts 256 new backends, which cost
        # it about 0.2 s of answers whatever the run's length (a 3 s run answered 0.93 × offered
        # at 0.5 and direct never kept up).
        self.shares = [0.5, 0.9] if quick else [0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3]
        self.seconds = 5 if quick else 10
        self.capacity_reps = 1 if quick else 3
        self.reps = 1 if quick else 2


def measure(bench: world.Bench, mode: Mode, raw: dict) -> None:
    log("warm-up")
    for t in TARGETS:
        bench.pgbench(phase="warmup", kind="warmup", scenario="warmup read", script="read",
                      qmode="simple", target=t, clients=32, threads=2, seconds=mode.t_warmup,
                      log_txns=False)
    for script in SCRIPTS:
        caps = []
        for rep in range(mode.capacity_reps):
            r = bench.pgbench(phase="capacity", kind="capacity", scenario=f"{script} capacity",
                              script=script, qmode="simple", target="direct", clients=CLIENTS,
                              threads=2, seconds=mode.seconds, rep=rep, log_txns=False)
            if r.get("ok") and r.get("tps"):
                caps.append(r["tps"])
        if not caps:
            raise RuntimeError(f"no capacity measured for {script}")
        capacity = statistics.median(caps)
        raw["capacity"][script] = {"median_tps": capacity, "runs": caps}
        log(f"{script}: C = {capacity:.0f} tps ({CLIENTS} clients, closed loop)")
        for rep in range(mode.reps):
            for i, share in enumerate(mode.shares):
                rate = max(1, round(capacity * share))
                for t in rotated(i + rep):
                    r = bench.pgbench(phase="measure", kind="open", scenario=f"{script} {share:.2f}",
                                      script=script, qmode="simple", target=t, clients=CLIENTS,
                                      threads=2, seconds=mode.seconds, rep=rep, log_txns=True,
                                      extra=["-R", str(rate), "-L", str(LIMIT_MS)])
                    r["share"] = share
                    r["offered_tps"] = rate
                    # Late or skipped transactions are what an open model is measured by: a
                    # run with some is not an error.
                    if r.get("transactions"):
                        r["ok"] = r.get("returncode") == 0
                        r.pop("error", None)


def summarize(raw: dict) -> dict:
    out: dict = {}
    for script in SCRIPTS:
        cap = raw["capacity"].get(script, {}).get("median_tps")
        rows = []
        knees = {}
        for r in raw["runs"]:
            if r["phase"] != "measure" or r["script"] != script or not r.get("transactions"):
                continue
            offered_n = r["offered_tps"] * r["seconds"]
            answered = r.get("tps") or 0
            timeouts = (r.get("skipped_transactions") or 0) + (r.get("late_transactions") or 0)
            row = {
                "rep": r.get("rep") or 0, "target": r["target"], "share": r["share"], "offered_tps": r["offered_tps"],
                "answered_tps": round(answered, 1), "p50_ms": r.get("p50_ms"), "p99_ms": r.get("p99_ms"),
                "timeouts": timeouts, "timeout_share": round(timeouts / offered_n, 4) if offered_n else None,
                "cpu_us": (r.get("cpu_us_per_txn") or {}).get(r["target"]),
            }
            row["keeps_up"] = (answered >= KEEPS_UP * r["offered_tps"]
                               and (row["timeout_share"] or 0) <= MAX_TIMEOUTS)
            rows.append(row)
        for t in TARGETS:
            knees[t] = []
            for k in sorted({x["rep"] for x in rows}):
                mine = sorted((x for x in rows if x["target"] == t and x["rep"] == k), key=lambda x: x["share"])
                # The knee: the highest share up to which every share kept up.
                knee = None
                for x in mine:
                    if not x["keeps_up"]:
                        break
                    knee = x["share"]
                knees[t].append(knee)
        # Each proxy's knee ÷ direct's, in the same repetition.
        relative = {t: [round(k / d, 2) if k is not None and d else None
                        for k, d in zip(knees[t], knees["direct"])] for t in PROXIES}
        out[script] = {"capacity_tps": cap, "rows": rows, "knee": knees, "knee_of_direct": relative}
    return out


def summary_markdown(raw: dict) -> str:
    meta, s = raw["meta"], raw["summary"]
    lines = [
        f"# Overload, open model ({meta['mode']}), run `{meta['run_id']}`",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"{CLIENTS} pgbench clients, 2 threads, `-R RATE -L {LIMIT_MS}`, {meta['seconds']} s per rate and "
        "target; rates as shares of C, direct's throughput closed loop with the same clients. Timeouts = skipped + "
        f"late (> {LIMIT_MS} ms from the scheduled start). Keeps up: answered ≥ {KEEPS_UP} × offered "
        f"and timeouts ≤ {MAX_TIMEOUTS:.0%}.",
        "",
    ]
    for script in SCRIPTS:
        c = s.get(script)
        if not c:
            continue
        knee = c["knee"]
        lines += [
            f"## {script}: C = {c['capacity_tps']:.0f} tps",
            "",
            "Knee (highest share of C kept up with, and every lower one), per repetition: "
            + "; ".join(f"{t} " + ", ".join("< lowest" if k is None else f"{k}" for k in knee.get(t, []))
                        for t in TARGETS),
            "",
            "**Knee ÷ direct's knee** (the same repetition): " + "; ".join(
                f"{t} " + ", ".join("–" if k is None else f"{k}" for k in c.get("knee_of_direct", {}).get(t, []))
                for t in PROXIES),
            "",
            "| share | offered tps | rep | target | answered tps | p50 ms | p99 ms | timeouts | keeps up | proxy CPU µs/txn |",
            "|---:|---:|---:|---|---:|---:|---:|---:|---|---:|",
        ]
        for x in sorted(c["rows"], key=lambda x: (x["share"], x["rep"], TARGETS.index(x["target"]))):
            ts = x["timeout_share"]
            lines.append(
                f"| {x['share']:.2f} | {x['offered_tps']} | {x['rep']} | {x['target']} | {x['answered_tps']:.0f} | "
                f"{x['p50_ms']} | {x['p99_ms']} | {x['timeouts']} ({ts:.2%}) | "
                f"{'yes' if x['keeps_up'] else 'no'} | {x['cpu_us'] if x['cpu_us'] is not None else '—'} |")
        lines.append("")
    if meta["errors"]:
        lines += ["## Errors", ""] + [f"- {e[:500]}" for e in meta["errors"]] + [""]
    return "\n".join(lines)


# The knee as a share of direct capacity: the reference's 0.9 (shared/seed/performance-reference.txt,
# "Overload": 22,500 of 25,000 ops/s accepted in full through LokaDB, the read only) and the goal
# ≥ 0.95 (RESULTS.md's overview, row "Overload"; issue 25).
REFERENCE_KNEE = 0.9
GOAL_KNEE = 0.95


def draw_chart(raw: dict, outdir: Path) -> str | None:
    """p99 against the offered share, per script and target, with the reference's knee and the
    goal drawn as vertical lines."""
    s = raw["summary"]
    fig, axes = plt.subplots(1, len(SCRIPTS), figsize=(10, 4.2), squeeze=False)
    colors = {"direct": "#57606a", "lokadb": "#1f6feb", "pgbouncer": "#d29922"}
    for ax, script in zip(axes[0], SCRIPTS):
        c = s.get(script)
        if not c:
            continue
        for t in TARGETS:
            for k in sorted({x["rep"] for x in c["rows"]}):
                pts = sorted((x for x in c["rows"] if x["target"] == t and x["rep"] == k),
                             key=lambda x: x["share"])
                ax.plot([x["share"] for x in pts], [x["p99_ms"] or 0 for x in pts], marker="o",
                        color=colors[t], ls="-" if k == 0 else "--",
                        label=f"{t}, rep {k} (knee {c['knee'][t][k] if k < len(c['knee'][t]) else '–'})")
        if script == "read":
            reference_line(ax, REFERENCE_KNEE, f"knee at {REFERENCE_KNEE:g} × direct's (read)", vertical=True)
        goal_line(ax, GOAL_KNEE, f"a proxy's knee ≥ {GOAL_KNEE:g} × direct's", vertical=True)
        ax.set_yscale("log")
        ax.set_xlabel("offered rate ÷ C (direct's closed-loop tps)")
        ax.set_ylabel("p99 latency, ms (log)")
        ax.set_title(f"{script}: C = {c['capacity_tps']:.0f} tps (direct, closed loop, {CLIENTS} clients)",
                     fontsize=9)
        ax.legend(fontsize=6)
    fig.suptitle(f"Overload, open model: p99 latency against the offered rate, {CLIENTS} clients, 1 s timeout "
                 f"({raw['meta']['mode']} mode, run {raw['meta']['run_id']})", fontsize=9)
    fig.tight_layout()
    save_png(fig, outdir / "overload-p99.png", 80)
    plt.close(fig)
    return "overload-p99.png"


def _write(raw: dict, outdir: Path, charts_data: bool) -> str:
    raw["summary"] = summarize(raw)
    return write_with_chart(raw, outdir, summary_markdown(raw), draw_chart, "p99 against the offered rate",
                            "overload", charts_data)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two rates (0.5, 0.9) of 5 s, 50,000 rows (≈ 1.3 min)")
    ap.add_argument("--out", type=Path, help="result folder (default research/bench/results/<UTC ts>-overload[-quick])")
    ap.add_argument("--render", type=Path, help="render summary.md and the chart again from this raw.json[.gz]")
    ap.add_argument("--no-charts-data", action="store_true", help="leave charts-data.md alone")
    args = ap.parse_args()
    if args.render:
        raw = read_raw(args.render)
        print(_write(raw, args.render.parent, not args.no_charts_data))
        write_raw_gz(args.render.parent, raw)
        return 0
    preflight("overload.py", [PG_BIN / "postgres", PG_BIN / "pgbench", PGBOUNCER_BIN,
                              LOKADB_BIN])
    mode = Mode(args.quick)
    started, run_id, outdir = result_dir(args.out, "-overload", mode.quick)
    raise_fd_limit()
    catch_signals()
    t_start = time.time()
    meta = run_meta(
        "overload.py", run_id, started, mode, seconds=mode.seconds, reps=mode.reps, shares=mode.shares,
        clients=CLIENTS, latency_limit_ms=LIMIT_MS, lokadb_binary=binary_info(), setup_commands=[],
        errors=[])
    raw = {"meta": meta, "capacity": {}, "runs": [], "summary": {}}
    code = world.three_targets(mode, meta, raw, lambda bench: measure(bench, mode, raw))
    finish_run(raw, outdir, t_start, lambda r, d, _c: _write(r, d, not args.out and not args.no_charts_data), False)
    write_raw_gz(outdir, raw)
    return code


if __name__ == "__main__":
    sys.exit(main())
