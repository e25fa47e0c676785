#!/usr/bin/env python3
"""LokaDB's headline figures measured as a user would: pgbench throughput through LokaDB and
through PgBouncer ÷ straight at Postgres, 32 clients, without per-transaction logging.

    /work/main/.venv/bin/python research/bench/headline.py [--quick] [--reps N] [--out DIR]

The world of run.py (one PostgreSQL 18 cluster, 200,000 documents of 100 organizations, LokaDB
with its defaults, PgBouncer 1.18 in transaction mode with a pool of 32: as many backends as
LokaDB's session pooling holds for 32 clients). Its scripts `read` (point read by key), `feed`
(an organization's 20 newest), `update` (by key) and `insert`, simple protocol (PgBouncer 1.18
has no prepared statements in transaction mode).

Each repetition runs, for each script, each target in an order rotated per repetition, twice:

  plain   pgbench -c 32 -j 2 -T S          (what a user runs: the throughput published)
  logged  pgbench -c 32 -j 2 -T S -l        (per-transaction log, as run.py measured until
                                           2026-12-07: the log's writing is pgbench CPU per
                                           transaction, taken from the same 2 cores)

and the ratio of each proxy to direct is taken within the repetition; the summary gives the
median and the spread (min–max) over repetitions. Latency percentiles come from separate runs
(-l, 1 client and 32 clients), never from the throughput runs. Proxy CPU per transaction from
/proc/PID/stat over each plain run. PgBouncer's settings are written beside the result.

Full: 5 repetitions of 8 s (about 20 minutes); quick: 2 of 1 s, latency runs 1 s (≈ 1.3 min).
Benchmarks the binaries in $LOKADB_BENCH_TARGET (default target/release); builds nothing.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib import three_targets as world  # noqa: E402  (run.py's world: Postgres, LokaDB, PgBouncer)
from lib.binaries import PG_BIN  # noqa: E402
from lib.charts import REFERENCE_STYLE, goal_line, marks, save_png  # noqa: E402
from lib.procs import catch_signals, log, preflight  # noqa: E402
from lib.results import finish_run, read_raw, result_dir, run_meta, write_raw_gz, write_with_chart  # noqa: E402
from lib.three_targets import (  # noqa: E402
    GOAL_TPS_RATIO, LOKADB_BIN, PGBOUNCER_BIN, PROXIES, REFERENCE_TPS_RATIO, TARGETS, binary_info, rotated,
)

import matplotlib.pyplot as plt  # noqa: E402  (lib set the Agg backend)

SCRIPTS = ["read", "feed", "update", "insert"]
VARIANTS = ["plain", "logged"]


class Mode(world.Mode):
    def __init__(self, quick: bool):
        super().__init__(quick)
        self.reps = 2 if quick else 5
        self.t_throughput = 1 if quick else 8
        self.t_latency = 1 if quick else 8


def measure(bench: world.Bench, mode: Mode) -> None:
    log("warm-up")
    for t in TARGETS:
        bench.pgbench(phase="warmup", kind="warmup", scenario="warmup read", script="read",
                      qmode="simple", target=t, clients=32, threads=2, seconds=mode.t_warmup,
                      log_txns=False)
    for rep in range(mode.reps):
        order = rotated(rep)
        log(f"repetition {rep + 1}/{mode.reps}, target order {order}")
        for script in SCRIPTS:
            # Alternate which variant goes first, so neither always follows the other.
            variants = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
            for variant in variants:
                for t in order:
                    bench.pgbench(phase="measure", kind=variant, scenario=f"{script} {variant}",
                                  script=script, qmode="simple", target=t, clients=32, threads=2,
                                  seconds=mode.t_throughput, rep=rep,
                                  log_txns=variant == "logged")
    log("latency (separate runs with -l)")
    for script in SCRIPTS:
        for clients, threads in ((1, 1), (32, 2)):
            for t in TARGETS:
                bench.pgbench(phase="latency", kind=f"latency c{clients}", scenario=f"{script} c{clients}",
                              script=script, qmode="simple", target=t, clients=clients,
                              threads=threads, seconds=mode.t_latency, log_txns=True)


def spread(vals: list[float]) -> dict:
    return {"median": round(statistics.median(vals), 3), "min": round(min(vals), 3),
            "max": round(max(vals), 3), "n": len(vals)}


def summarize(runs: list[dict]) -> dict:
    """Per script and variant: each proxy's tps ÷ direct's of the same repetition, and tps and
    proxy CPU per transaction; per script and client count: latency p50/p99 per target."""
    out: dict = {"throughput": {}, "latency": {}}
    ok = [r for r in runs if r.get("ok")]
    for script in SCRIPTS:
        for variant in VARIANTS:
            cell: dict = {}
            reps = sorted({r["rep"] for r in ok if r["phase"] == "measure"})
            by = {(r["rep"], r["target"]): r for r in ok
                  if r["phase"] == "measure" and r["script"] == script and r["phase_kind"] == variant}
            for t in TARGETS:
                tps = [by[(k, t)]["tps"] for k in reps if (k, t) in by]
                if tps:
                    cell[f"{t}_tps"] = spread(tps)
            pair = [by[(k, "lokadb")]["tps"] / by[(k, "pgbouncer")]["tps"] for k in reps
                    if (k, "lokadb") in by and (k, "pgbouncer") in by and by[(k, "pgbouncer")]["tps"]]
            if pair:
                cell["lokadb_per_pgbouncer"] = spread(pair)
                cell["lokadb_ahead"] = sum(1 for x in pair if x > 1)
            for t in PROXIES:
                ratios = [by[(k, t)]["tps"] / by[(k, "direct")]["tps"] for k in reps
                          if (k, t) in by and (k, "direct") in by and by[(k, "direct")]["tps"]]
                if ratios:
                    cell[f"{t}_ratio"] = spread(ratios)
                cpu = [by[(k, t)]["cpu_us_per_txn"][t] for k in reps
                       if (k, t) in by and by[(k, t)]["cpu_us_per_txn"].get(t) is not None]
                if cpu:
                    cell[f"{t}_cpu_us"] = spread(cpu)
            out["throughput"][f"{script} {variant}"] = cell
        for clients in (1, 32):
            cell = {}
            for r in ok:
                if r["phase"] == "latency" and r["script"] == script and r["clients"] == clients:
                    cell[r["target"]] = {"p50_ms": r.get("p50_ms"), "p99_ms": r.get("p99_ms"),
                                         "tps": r.get("tps")}
            out["latency"][f"{script} c{clients}"] = cell
    return out


def fmt_spread(s: dict | None, nd=3) -> str:
    if not s:
        return "—"
    return f"**{s['median']:.{nd}f}** ({s['min']:.{nd}f}–{s['max']:.{nd}f})"


def summary_markdown(raw: dict) -> str:
    meta, s = raw["meta"], raw["summary"]
    lines = [
        f"# Headline figures ({meta['mode']}), run `{meta['run_id']}`",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"{meta['reps']} repetitions × {meta['throughput_seconds']} s per target, script and variant, "
        "targets interleaved (order rotated per repetition); 32 clients, 2 pgbench threads, simple "
        "protocol. Ratios are each repetition's proxy tps ÷ direct tps, then the median (min–max).",
        "",
        "## Throughput ÷ direct, measured as a user would (pgbench without -l)",
        "",
        "| script | LokaDB ÷ direct | PgBouncer ÷ direct | LokaDB ÷ PgBouncer (ahead in) | direct tps (min–max) | LokaDB CPU µs/txn | PgBouncer CPU µs/txn |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for script in SCRIPTS:
        c = s["throughput"].get(f"{script} plain", {})
        d = c.get("direct_tps", {})
        lines.append(
            f"| {script} | {fmt_spread(c.get('lokadb_ratio'))} | {fmt_spread(c.get('pgbouncer_ratio'))} | "
            f"{fmt_spread(c.get('lokadb_per_pgbouncer'))} ({c.get('lokadb_ahead', '—')} of {meta['reps']}) | "
            f"{d.get('median', 0):.0f} ({d.get('min', 0):.0f}–{d.get('max', 0):.0f}) | "
            f"{fmt_spread(c.get('lokadb_cpu_us'), 1)} | {fmt_spread(c.get('pgbouncer_cpu_us'), 1)} |")
    lines += [
        "",
        "## The same with pgbench's per-transaction log (-l), as run.py measured",
        "",
        "| script | LokaDB ÷ direct | PgBouncer ÷ direct | LokaDB ÷ PgBouncer (ahead in) | direct tps, median (plain → logged) |",
        "|---|---|---|---|---:|",
    ]
    for script in SCRIPTS:
        c = s["throughput"].get(f"{script} logged", {})
        p = s["throughput"].get(f"{script} plain", {})
        lines.append(
            f"| {script} | {fmt_spread(c.get('lokadb_ratio'))} | {fmt_spread(c.get('pgbouncer_ratio'))} | "
            f"{fmt_spread(c.get('lokadb_per_pgbouncer'))} ({c.get('lokadb_ahead', '—')} of {meta['reps']}) | "
            f"{p.get('direct_tps', {}).get('median', 0):.0f} → {c.get('direct_tps', {}).get('median', 0):.0f} |")
    lines += [
        "",
        "## Latency (separate runs with -l), p50 / p99 ms",
        "",
        "| script | clients | direct | LokaDB | PgBouncer |",
        "|---|---:|---|---|---|",
    ]
    for script in SCRIPTS:
        for clients in (1, 32):
            c = s["latency"].get(f"{script} c{clients}", {})
            cells = []
            for t in TARGETS:
                v = c.get(t) or {}
                cells.append(f"{v.get('p50_ms', '—')} / {v.get('p99_ms', '—')}")
            lines.append(f"| {script} | {clients} | " + " | ".join(cells) + " |")
    lines += ["", "## PgBouncer's settings", "", f"{meta['pgbouncer_version']}", "", "```ini",
              meta["pgbouncer_ini"].strip(), "```", "",
              f"LokaDB: `{meta['lokadb_command']}` with its configuration's defaults (session pooling, "
              "all cores).", ""]
    if meta["errors"]:
        lines += ["## Errors", ""] + [f"- {e[:500]}" for e in meta["errors"]] + [""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 repetitions of 1 s, 50,000 rows (≈ 1.3 min)")
    ap.add_argument("--reps", type=int, help="repetitions (default 5, quick 2)")
    ap.add_argument("--out", type=Path, help="result folder (default research/bench/results/<UTC ts>-headline[-quick])")
    ap.add_argument("--render", type=Path, help="render summary.md again from this raw.json[.gz]")
    ap.add_argument("--no-charts-data", action="store_true", help="leave charts-data.md alone")
    args = ap.parse_args()
    if args.render:
        raw = read_raw(args.render)
        raw["summary"] = summarize(raw["runs"])
        print(_write(raw, args.render.parent, not args.no_charts_data))
        write_raw_gz(args.render.parent, raw)
        return 0
    preflight("headline.py", [PG_BIN / "postgres", PG_BIN / "pgbench", PGBOUNCER_BIN,
                              LOKADB_BIN])
    mode = Mode(args.quick)
    if args.reps is not None:
        if args.reps < 1:
            sys.exit(f"--reps {args.reps}: at least 1 repetition")
        mode.reps = args.reps
    started, run_id, outdir = result_dir(args.out, "-headline", mode.quick)
    catch_signals()
    t_start = time.time()
    meta = run_meta(
        "headline.py", run_id, started, mode, reps=mode.reps, throughput_seconds=mode.t_throughput,
        latency_seconds=mode.t_latency, lokadb_binary=binary_info(),
        pgbouncer_version=subprocess.run([str(PGBOUNCER_BIN), "--version"], capture_output=True,
                                         text=True).stdout.splitlines()[0],
        setup_commands=[], errors=[])
    raw = {"meta": meta, "runs": [], "summary": {}}
    code = world.three_targets(mode, meta, raw, lambda bench: measure(bench, mode))
    raw["summary"] = summarize(raw["runs"])
    finish_run(raw, outdir, t_start, lambda r, d, _c: _write(r, d, not args.out and not args.no_charts_data), False)
    write_raw_gz(outdir, raw)
    return code


# The reference's LokaDB ÷ direct with 32 clients, per script: its ops/s divided
# (shared/seed/performance-reference.txt, "Organizations that stay in the cloud": read 29,799 ÷
# 66,496, feed 28,375 ÷ 35,526, update 33,880 ÷ 57,166, insert 8,612 ÷ 23,673; RESULTS.md's
# overview, row "Proxy overhead"). The goal: ≥ 0.9 (the same row).
REFERENCE_RATIO = REFERENCE_TPS_RATIO
GOAL_RATIO = GOAL_TPS_RATIO


def draw_chart(raw: dict, outdir: Path) -> str | None:
    """throughput-ratio.png: each proxy's median ratio to direct per script, the bars' whiskers
    the spread over repetitions, the reference's ratio per script and the goal (0.9) drawn."""
    s = raw["summary"]["throughput"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    w = 0.38
    for i, (t, label, color) in enumerate((("lokadb", "LokaDB", "#1f6feb"),
                                           ("pgbouncer", "PgBouncer 1.18, transaction, pool 32", "#d29922"))):
        cells = [s.get(f"{sc} plain", {}).get(f"{t}_ratio") for sc in SCRIPTS]
        if not all(cells):
            plt.close(fig)
            return None
        xs = [j + (i - 0.5) * w for j in range(len(SCRIPTS))]
        med = [c["median"] for c in cells]
        err = [[m - c["min"] for m, c in zip(med, cells)], [c["max"] - m for m, c in zip(med, cells)]]
        ax.bar(xs, med, w, yerr=err, capsize=3, label=label, color=color)
        for x, m in zip(xs, med):
            ax.text(x, 0.02, f"{m:.2f}", ha="center", va="bottom", fontsize=8, color="white")
    marks(ax, list(range(len(SCRIPTS))), [REFERENCE_RATIO.get(sc) for sc in SCRIPTS], 2 * w,
          "reference: LokaDB ÷ direct " + " / ".join(f"{REFERENCE_RATIO[sc]:.2f}" for sc in SCRIPTS)
          + f" ({' / '.join(SCRIPTS)})", REFERENCE_STYLE)
    goal_line(ax, GOAL_RATIO, f"≥ {GOAL_RATIO:g} × direct")
    ax.set_xticks(range(len(SCRIPTS)))
    ax.set_xticklabels(SCRIPTS)
    ax.set_ylim(0, 1.5)
    ax.set_ylabel("throughput ÷ direct (median, whiskers min–max)")
    meta = raw["meta"]
    ax.set_title(f"Throughput through the proxy ÷ direct, 32 clients, pgbench without -l, simple protocol\n"
                 f"{meta['reps']} × {meta['throughput_seconds']} s interleaved, 2 cores ({meta['mode']} mode, "
                 f"run {meta['run_id']})", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    save_png(fig, outdir / "throughput-ratio.png", 80)
    plt.close(fig)
    return "throughput-ratio.png"


def _write(raw: dict, outdir: Path, charts_data: bool) -> str:
    return write_with_chart(raw, outdir, summary_markdown(raw), draw_chart, "throughput ÷ direct", "headline",
                            charts_data)


if __name__ == "__main__":
    sys.exit(main())
