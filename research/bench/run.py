#!/usr/bin/env python3
"""LokaDB proxy-core benchmark: direct Postgres vs LokaDB proxy vs PgBouncer, side by side.

    /work/main/.venv/bin/python research/bench/run.py [--quick] [--out DIR]

Sets up its own world (a throwaway PostgreSQL 18 cluster, the LokaDB proxy, PgBouncer),
runs pgbench scenarios interleaved across the three targets, repeats them, and writes
raw.json, summary.md and PNG charts into research/bench/results/<UTC timestamp>[-quick]/,
and the numbers behind the charts into research/bench/charts-data.md.
See research/bench/README.md for the method and how to read the results.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lib.binaries import PG_BIN  # noqa: E402
from lib.charts import GOAL_STYLE, REFERENCE_STYLE, goal_line, marks, save_png  # noqa: E402
from lib.procs import (  # noqa: E402
    CLK_TCK, catch_signals, cpu_ticks, ignore_signals, log, raise_fd_limit, rss_kib, safe_cleanup,
)
from lib.results import git_info, machine_info, rerender, result_dir, write_charts_section  # noqa: E402
from lib.three_targets import (  # noqa: E402
    GOAL_ADDED_P50_MS, GOAL_CONNECT_RATIO, GOAL_TPS_RATIO, LOKADB_BIN, ORGS, PGBOUNCER_BIN, PROXIES, QUERY_MODES,
    REFERENCE_ADDED_P50_MS, REFERENCE_CONNECT_RATIO, REFERENCE_TPS_RATIO, SCRIPTS, TARGETS, Bench, Mode, World,
    binary_info, rotated,
)

import matplotlib.pyplot as plt  # noqa: E402  (lib set the Agg backend)


# --------------------------------------------------------------------------------------
# Idle clients and RSS


def idle_clients_test(world: World, target: str, n: int) -> dict:
    pid = world.pid_of(target)
    port = world.port_of(target)
    res = {"target": target, "requested_clients": n}
    res["rss_kib_idle_before"] = rss_kib(pid)
    with world.superuser_conn() as c:
        res["pg_backends_before"] = c.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = 'app'"
        ).fetchone()[0]
    conns = []
    errors: dict[str, int] = {}
    lock = threading.Lock()

    def one(_):
        try:
            c = world.app_conn(port)
            with lock:
                conns.append(c)
        except Exception as e:
            msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else repr(e)
            with lock:
                errors[msg] = errors.get(msg, 0) + 1

    t0 = time.time()
    ticks0 = cpu_ticks(pid)
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as ex:
        list(ex.map(one, range(n)))
    res["connect_seconds"] = round(time.time() - t0, 2)
    res["cpu_ticks_connecting"] = cpu_ticks(pid) - ticks0
    res["opened_clients"] = len(conns)
    res["connect_errors"] = errors
    time.sleep(2)
    # Verify a sample of them is authenticated and usable.
    sample_ok = 0
    for c in conns[:: max(1, len(conns) // 10)]:
        try:
            c.execute("SELECT 1").fetchone()
            sample_ok += 1
        except Exception:
            pass
    res["sample_checked_ok"] = sample_ok
    time.sleep(1)
    res["rss_kib_with_clients"] = rss_kib(pid)
    with world.superuser_conn() as c:
        res["pg_backends_with_clients"] = c.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = 'app'"
        ).fetchone()[0]
    for c in conns:
        try:
            c.close()
        except Exception:
            pass
    time.sleep(2)
    res["rss_kib_after_close"] = rss_kib(pid)
    if conns:
        res["rss_kib_per_idle_client"] = round(
            (res["rss_kib_with_clients"] - res["rss_kib_idle_before"]) / len(conns), 2
        )
    if errors:
        res["error"] = f"{n - len(conns)} of {n} connections failed: {errors}"
    res["cpu_us_per_connect"] = (
        round(res["cpu_ticks_connecting"] / CLK_TCK * 1e6 / len(conns), 1) if conns else None
    )
    return res


# --------------------------------------------------------------------------------------
# Summaries


def med(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def fmt(v, nd=2, suffix=""):
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:,.{nd}f}{suffix}"
    return f"{v:,}{suffix}"


def summarize(runs: list[dict], reps: int) -> dict:
    """Per scenario: medians of absolute values and medians of per-repetition ratios."""
    meas = [r for r in runs if r["phase"] == "measure"]
    scenarios = []
    for r in meas:
        if r["scenario"] not in scenarios:
            scenarios.append(r["scenario"])
    out = {}
    for sc in scenarios:
        rs = [r for r in meas if r["scenario"] == sc]
        entry = {"kind": rs[0]["phase_kind"], "script": rs[0]["script"],
                 "query_mode": rs[0]["query_mode"], "clients": rs[0]["clients"], "targets": {}}
        by_rep = {}
        for r in rs:
            by_rep.setdefault(r["rep"], {})[r["target"]] = r
        for t in TARGETS:
            tr = [r for r in rs if r["target"] == t]
            okr = [r for r in tr if r["ok"]]
            entry["targets"][t] = {
                "runs": len(tr),
                "ok_runs": len(okr),
                "errors": sorted({r.get("error", "") for r in tr if not r["ok"] or r.get("error")} - {""}),
                "first_errors": sorted({re.sub(r"client \d+ ", "", r.get("first_error", "")) for r in tr if not r["ok"]} - {""}),
                "tps": med([r["tps"] for r in okr]),
                "p50_ms": med([r["p50_ms"] for r in okr]),
                "p99_ms": med([r["p99_ms"] for r in okr]),
                "transactions": med([r["transactions"] for r in okr]),
                "cpu_us_per_txn": med([r["cpu_us_per_txn"].get(t) for r in okr]) if t in PROXIES else None,
            }
        for t in PROXIES:
            ratios, added = [], []
            for rep, d in by_rep.items():
                a, b = d.get("direct"), d.get(t)
                if a and b and a["ok"] and b["ok"]:
                    if a["tps"] and b["tps"] is not None:
                        ratios.append(b["tps"] / a["tps"])
                    if a["p50_ms"] is not None and b["p50_ms"] is not None:
                        added.append(b["p50_ms"] - a["p50_ms"])
            entry["targets"][t]["tps_ratio"] = med(ratios)
            entry["targets"][t]["tps_ratios_per_rep"] = [round(x, 4) for x in ratios]
            entry["targets"][t]["added_p50_ms"] = med(added)
            entry["targets"][t]["added_p50_per_rep"] = [round(x, 4) for x in added]
        out[sc] = entry
    return out


def status_cell(t):
    why = ""
    if t.get("first_errors"):
        why = " (" + t["first_errors"][0].replace("pgbench: error: ", "").replace("|", "/")[:120] + ")"
    if t["ok_runs"] == 0:
        return "FAILED" + why
    if t["ok_runs"] < t["runs"]:
        return f"{t['ok_runs']}/{t['runs']} ok" + why
    return ""


def summary_markdown(meta: dict, summary: dict, idle: list[dict]) -> str:
    L = []
    q = f" (QUICK MODE: short runs, R={meta['reps']} — indicative only)" if meta["mode"] == "quick" else ""
    L.append(f"# Proxy-core benchmark — {meta['run_id']}{q}\n")
    L.append(
        f"Machine: {meta['machine']['nproc']} cores, `{meta['machine']['uname']}`; "
        f"commit `{meta['git']['commit'][:12]}`{' (working tree dirty)' if meta['git']['dirty'] else ''}; "
        f"{meta['postgres']['version'].split(',')[0]}; {meta['pgbouncer_version']}; "
        f"{meta['data']['rows']:,} rows in {meta['data']['organizations']} organizations; "
        f"R={meta['reps']} repetitions, median shown; durations: 1 client {meta['durations']['latency_s']} s, "
        f"32 clients {meta['durations']['throughput_s']} s, connect-per-transaction {meta['durations']['connect_s']} s. "
        f"Load generator (pgbench), proxies and Postgres share the same {meta['machine']['nproc']} cores; "
        f"Postgres runs with synchronous_commit=off. Total run time {meta['duration_seconds']:.0f} s.\n"
    )
    L.append(
        f"LokaDB pool_mode: **{meta.get('lokadb_pool_mode', 'session')}**"
        + (" (pool_size 32, as PgBouncer's)" if meta.get("lokadb_pool_mode") == "transaction" else "")
        + f"; PgBouncer pool_mode transaction, default_pool_size 32; the app role's SCRAM iterations: "
        f"{meta['client_settings'].get('scram_iterations', 4096)}. Command: `{meta.get('command', 'run.py')}`.\n"
    )

    L.append("## One client: p50 / p99 latency (ms) and the p50 added over direct\n")
    L.append("| scenario | direct p50 | LokaDB p50 | LokaDB added p50 | PgBouncer p50 | PgBouncer added p50 | direct p99 | LokaDB p99 | PgBouncer p99 | notes |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for sc, e in summary.items():
        if e["kind"] != "latency":
            continue
        d, l, b = (e["targets"][t] for t in TARGETS)
        notes = "; ".join(f"{t}: {status_cell(e['targets'][t])}" for t in TARGETS if status_cell(e["targets"][t]))
        L.append(
            f"| {sc} | {fmt(d['p50_ms'], 3)} | {fmt(l['p50_ms'], 3)} | {fmt(l['added_p50_ms'], 3, '')} | "
            f"{fmt(b['p50_ms'], 3)} | {fmt(b['added_p50_ms'], 3)} | {fmt(d['p99_ms'], 3)} | "
            f"{fmt(l['p99_ms'], 3)} | {fmt(b['p99_ms'], 3)} | {notes} |"
        )
    L.append("")

    def ratio_table(title, kind):
        L.append(title)
        L.append("| scenario | direct tps | LokaDB tps | LokaDB ÷ direct | PgBouncer tps | PgBouncer ÷ direct | notes |")
        L.append("|---|---:|---:|---:|---:|---:|---|")
        for sc, e in summary.items():
            if e["kind"] != kind:
                continue
            d, l, b = (e["targets"][t] for t in TARGETS)
            notes = "; ".join(f"{t}: {status_cell(e['targets'][t])}" for t in TARGETS if status_cell(e["targets"][t]))
            L.append(
                f"| {sc} | {fmt(d['tps'], 0)} | {fmt(l['tps'], 0)} | {fmt(l['tps_ratio'], 3)} | "
                f"{fmt(b['tps'], 0)} | {fmt(b['tps_ratio'], 3)} | {notes} |"
            )
        L.append("")

    ratio_table("## 32 clients (`-c 32 -j 2`): throughput, and ÷ direct\n", "throughput")
    ratio_table("## A new connection per transaction (`-C -c 16 -j 2`, point read, simple)\n", "connect")

    L.append("## CPU time per statement of the proxy process (µs, utime+stime from /proc ÷ transactions)\n")
    L.append(f"Clock tick = {1e6 / CLK_TCK:.0f} µs; one statement per transaction in every script.\n")
    L.append("| scenario | LokaDB µs/stmt | PgBouncer µs/stmt | LokaDB ÷ PgBouncer |")
    L.append("|---|---:|---:|---:|")
    for sc, e in summary.items():
        l, b = e["targets"]["lokadb"], e["targets"]["pgbouncer"]
        ratio = (l["cpu_us_per_txn"] / b["cpu_us_per_txn"]) if (l["cpu_us_per_txn"] and b["cpu_us_per_txn"]) else None
        L.append(f"| {sc} | {fmt(l['cpu_us_per_txn'], 1)} | {fmt(b['cpu_us_per_txn'], 1)} | {fmt(ratio, 2)} |")
    L.append("")

    L.append("## Memory: RSS idle and with idle authenticated clients\n")
    L.append("| target | RSS at start (MiB) | RSS before (MiB) | clients opened | RSS with clients (MiB) | KiB per idle client | RSS after close (MiB) | Postgres backends before → with clients | connect time (s) | CPU µs per connect | errors |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in idle:
        L.append(
            f"| {r['target']} | {fmt(r.get('rss_kib_at_start', 0) / 1024, 1)} | {fmt(r['rss_kib_idle_before'] / 1024, 1)} | "
            f"{r['opened_clients']}/{r['requested_clients']} | {fmt(r['rss_kib_with_clients'] / 1024, 1)} | "
            f"{fmt(r.get('rss_kib_per_idle_client'), 1)} | {fmt(r['rss_kib_after_close'] / 1024, 1)} | "
            f"{r.get('pg_backends_before')} → {r['pg_backends_with_clients']} | {fmt(r['connect_seconds'], 2)} | {fmt(r.get('cpu_us_per_connect'), 0)} | "
            f"{r.get('error', '')} |"
        )
    L.append("")
    errs = meta.get("errors") or []
    if errs:
        L.append("## Errors\n")
        for e in errs:
            L.append(f"- {e}")
        L.append("")
    L.append("Raw numbers of every run, with the exact commands: `raw.json`. Method: `research/bench/README.md`.\n")
    return "\n".join(L)


def draw_charts(outdir: Path, summary: dict, idle: list[dict], title_suffix: str) -> list[str]:
    files = []
    colors = {"lokadb": "#1f6feb", "pgbouncer": "#d29922"}
    labels = {"lokadb": "LokaDB", "pgbouncer": "PgBouncer"}

    def bars(kinds, key, fname, ylabel, title, hline=None, refs=None, value_fmt="{:.2f}", legend_loc="upper left"):
        """refs(ax, scs, width): draws the reference's and the goal's figures."""
        scs = [sc for sc, e in summary.items() if e["kind"] in kinds]
        if not scs:
            return
        fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(scs) + 2), 4.8))
        w = 0.38
        for i, t in enumerate(PROXIES):
            vals = [summary[sc]["targets"][t].get(key) for sc in scs]
            xs = [j + (i - 0.5) * w for j in range(len(scs))]
            ax.bar(xs, [v if v is not None else 0 for v in vals], w, label=labels[t], color=colors[t])
            for x, v in zip(xs, vals):
                ax.text(x, (v or 0), "failed" if v is None else value_fmt.format(v), ha="center",
                        va="bottom", fontsize=7, rotation=90 if len(scs) > 6 else 0)
        if hline is not None:
            ax.axhline(hline, color="grey", lw=0.8, ls=":", label=f"= direct ({hline:g})")
        if refs is not None:
            refs(ax, scs, 2 * w)
        ax.set_xticks(range(len(scs)))
        ax.set_xticklabels(scs, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.margins(y=0.15)
        ax.set_title(title + title_suffix, fontsize=10)
        ax.legend(fontsize=7, loc=legend_loc)
        fig.tight_layout()
        save_png(fig, outdir / fname, 110)
        plt.close(fig)
        files.append(fname)

    def script_of(sc):
        return sc.split()[0]

    def ratio_refs(ax, scs, width):
        xs = list(range(len(scs)))
        conn = [summary[sc]["kind"] == "connect" for sc in scs]
        marks(ax, xs, [REFERENCE_CONNECT_RATIO if c else REFERENCE_TPS_RATIO.get(script_of(sc))
                       for sc, c in zip(scs, conn)], width,
              "reference: LokaDB ÷ direct, 32 clients " + " / ".join(f"{v:.2f}" for v in REFERENCE_TPS_RATIO.values())
              + f" ({' / '.join(REFERENCE_TPS_RATIO)}); a new connection per request {REFERENCE_CONNECT_RATIO:g}",
              REFERENCE_STYLE)
        marks(ax, xs, [GOAL_CONNECT_RATIO if c else GOAL_TPS_RATIO for c in conn], width,
              f"goal: ≥ {GOAL_TPS_RATIO:g} with 32 clients, ≥ {GOAL_CONNECT_RATIO:g} with a new connection per request",
              GOAL_STYLE)

    def added_refs(ax, scs, width):
        marks(ax, list(range(len(scs))), [REFERENCE_ADDED_P50_MS.get(script_of(sc)) for sc in scs], width,
              "reference: LokaDB's added p50 " + " / ".join(f"{v:g}" for v in REFERENCE_ADDED_P50_MS.values())
              + f" ms ({' / '.join(REFERENCE_ADDED_P50_MS)})", REFERENCE_STYLE)
        goal_line(ax, GOAL_ADDED_P50_MS, f"≤ {GOAL_ADDED_P50_MS:g} ms added")
        # The reference's 0.17–1.06 ms beside our 0.03–0.05: linear around 0, logarithmic above.
        ax.set_yscale("symlog", linthresh=0.1, linscale=2)
        ax.set_ylim(-0.1, 2)
        ticks = [-0.05, 0, 0.05, 0.1, 0.2, 0.5, 1, 2]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()

    bars({"throughput", "connect"}, "tps_ratio", "throughput-ratio.png", "throughput ÷ direct (median of R)",
         "Throughput through the proxy ÷ direct (32 clients; -C: 16 clients)", hline=1.0, refs=ratio_refs)
    bars({"latency"}, "added_p50_ms", "added-p50.png", "p50 added over direct, ms (symlog above 0.1)",
         "p50 latency added over direct, one client", refs=added_refs, value_fmt="{:.3f}", legend_loc="lower left")
    bars({"latency", "throughput", "connect"}, "cpu_us_per_txn", "cpu-per-statement.png",
         "proxy CPU per statement, µs (utime + stime)", "Proxy process CPU time per statement")
    if idle:
        fig, ax = plt.subplots(figsize=(6, 4))
        names = [labels[r["target"]] for r in idle]
        before = [r["rss_kib_idle_before"] / 1024 for r in idle]
        withc = [r["rss_kib_with_clients"] / 1024 for r in idle]
        xs = range(len(idle))
        ax.bar([x - 0.2 for x in xs], before, 0.4, label="idle", color="#8b949e")
        ax.bar([x + 0.2 for x in xs], withc, 0.4,
               label=f"with {idle[0]['requested_clients']} idle clients", color="#1f6feb")
        for x, v in zip(xs, withc):
            ax.text(x + 0.2, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
        for x, v in zip(xs, before):
            ax.text(x - 0.2, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names)
        ax.set_ylabel("RSS (MiB)")
        ax.set_title("Proxy RSS, idle and with idle clients" + title_suffix, fontsize=10)
        ax.legend()
        fig.tight_layout()
        save_png(fig, outdir / "rss.png", 110)
        plt.close(fig)
        files.append("rss.png")
    return files


def charts_data_section(meta: dict, summary: dict, idle: list[dict], outdir: Path, charts: list[str]) -> str:
    rel = os.path.relpath(outdir, HERE)
    q = f" — short runs, R={meta['reps']}; indicative only" if meta["mode"] == "quick" else ""
    tx = (", LokaDB pooling by transaction (pool_size 32), the app role's SCRAM iterations "
          f"{meta['client_settings'].get('scram_iterations', 4096)}"
          if meta.get("lokadb_pool_mode") == "transaction" else "")
    L = [f"## Proxy core, {meta['mode']} mode{tx}{q}\n",
         f"Run `{meta['run_id']}` (folder `{rel}/`), commit `{meta['git']['commit'][:12]}`"
         f"{' (dirty tree)' if meta['git']['dirty'] else ''}, {meta['machine']['nproc']} cores, "
         f"{meta['data']['rows']:,} rows / {meta['data']['organizations']} organizations, R={meta['reps']}, medians. "
         f"Charts: {', '.join(f'`{rel}/{c}`' for c in charts)}.\n"]
    L.append("### throughput-ratio.png — throughput ÷ direct\n")
    L.append("| scenario | direct tps | LokaDB ÷ direct | PgBouncer ÷ direct |")
    L.append("|---|---:|---:|---:|")
    for sc, e in summary.items():
        if e["kind"] in ("throughput", "connect"):
            t = e["targets"]
            L.append(f"| {sc} | {fmt(t['direct']['tps'], 0)} | {fmt(t['lokadb']['tps_ratio'], 3)} | {fmt(t['pgbouncer']['tps_ratio'], 3)} |")
    L.append("\n### added-p50.png — p50 added over direct, one client (ms)\n")
    L.append("| scenario | direct p50 | LokaDB added | PgBouncer added |")
    L.append("|---|---:|---:|---:|")
    for sc, e in summary.items():
        if e["kind"] == "latency":
            t = e["targets"]
            L.append(f"| {sc} | {fmt(t['direct']['p50_ms'], 3)} | {fmt(t['lokadb']['added_p50_ms'], 3)} | {fmt(t['pgbouncer']['added_p50_ms'], 3)} |")
    L.append("\n### cpu-per-statement.png — proxy CPU µs per statement\n")
    L.append("| scenario | LokaDB | PgBouncer |")
    L.append("|---|---:|---:|")
    for sc, e in summary.items():
        t = e["targets"]
        L.append(f"| {sc} | {fmt(t['lokadb']['cpu_us_per_txn'], 1)} | {fmt(t['pgbouncer']['cpu_us_per_txn'], 1)} |")
    if idle:
        L.append("\n### rss.png — RSS (MiB)\n")
        L.append("| target | idle | with idle clients | clients | KiB per idle client |")
        L.append("|---|---:|---:|---:|---:|")
        for r in idle:
            L.append(f"| {r['target']} | {r['rss_kib_idle_before'] / 1024:.1f} | {r['rss_kib_with_clients'] / 1024:.1f} | {r['opened_clients']} | {fmt(r.get('rss_kib_per_idle_client'), 1)} |")
    L.append("")
    return "\n".join(L)


def update_charts_data(section: str, mode: str) -> None:
    write_charts_section(f"proxy-core {mode}", section)


# --------------------------------------------------------------------------------------
# Main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 s runs, 50k rows, R=1 (≈ 1.3 min)")
    ap.add_argument("--out", type=Path, help="result folder (default research/bench/results/<UTC ts>[-quick])")
    ap.add_argument("--reps", type=int, help="override the number of repetitions R")
    ap.add_argument("--pool-mode", choices=["session", "transaction"], default="session",
                    help="LokaDB's pool_mode (transaction: pool_size 32, as PgBouncer's pool)")
    ap.add_argument("--scram-iterations", type=int, default=4096,
                    help="SCRAM iterations of the app role (Postgres' default 4096)")
    ap.add_argument("--no-charts-data", action="store_true", help="do not update research/bench/charts-data.md")
    ap.add_argument("--render", type=Path, help="only rebuild summary.md, the charts and charts-data.md from this "
                                                "raw.json or raw.json.gz (its summary as recorded)")
    args = ap.parse_args()
    if args.render:
        return rerender(args.render, render_proxy_core, not args.no_charts_data)

    if os.geteuid() != 0:
        sys.exit("run.py must run as root (it starts Postgres and PgBouncer as the user lokadb-pg)")
    for p in (PG_BIN / "postgres", PG_BIN / "pgbench", PGBOUNCER_BIN):
        if not Path(p).exists():
            sys.exit(f"missing {p}: run scripts/setup.sh first")
    if not LOKADB_BIN.exists():
        sys.exit(f"missing {LOKADB_BIN}: build the proxy first (cargo build --release)")

    mode = Mode(args.quick)
    if args.reps:
        mode.reps = args.reps
    mode.pool_mode = args.pool_mode
    mode.scram_iterations = args.scram_iterations
    tag = "-tx" if args.pool_mode == "transaction" else ""
    started, run_id, outdir = result_dir(args.out, tag, mode.quick)

    # 1000 idle clients need fds in this process, the proxy and PgBouncer (children inherit).
    raise_fd_limit()
    catch_signals()

    setup_commands: list[str] = []
    meta = {
        "run_id": run_id, "mode": mode.name, "started_utc": started.isoformat(),
        "reps": mode.reps, "organizations": ORGS,
        "durations": {"latency_s": mode.t_latency, "throughput_s": mode.t_throughput,
                      "connect_s": mode.t_connect, "warmup_s": mode.t_warmup},
        "machine": machine_info(), "git": git_info(), "lokadb_binary": binary_info(),
        "pgbouncer_version": subprocess.run([str(PGBOUNCER_BIN), "--version"], capture_output=True,
                                            text=True).stdout.splitlines()[0],
        "pgbench_version": subprocess.run([str(PG_BIN / "pgbench"), "--version"], capture_output=True,
                                          text=True).stdout.strip(),
        "LOKADB_CORES": os.environ.get("LOKADB_CORES", "(unset: all cores)"),
        "postgres_settings": {"synchronous_commit": "off", "fsync": "on (default)",
                              "max_connections": 1200, "shared_buffers": "256MB",
                              "password_encryption": "scram-sha-256"},
        "client_settings": {"sslmode": "disable", "auth": "SCRAM-SHA-256 as role app",
                            "scram_iterations": mode.scram_iterations},
        "lokadb_pool_mode": mode.pool_mode,
        "command": "/work/main/.venv/bin/python research/bench/run.py " + " ".join(sys.argv[1:]),
        "setup_commands": setup_commands,
        "errors": [],
    }
    raw = {"meta": meta, "runs": [], "idle_clients": [], "summary": {}}
    t_start = time.time()
    world = None
    bench = None
    exit_code = 0
    try:
        log(f"mode={mode.name} R={mode.reps} rows={mode.rows} out={outdir}")
        world = World(mode, setup_commands)
        log("initdb + start PostgreSQL 18")
        world.start_postgres()
        meta["data"] = world.create_roles_and_data()
        meta["postgres"] = {"version": meta["data"].pop("postgres_version"), "port": world.pg_port}
        log(f"loaded {meta['data']['rows']} rows in {meta['data']['load_seconds']} s")
        log("start LokaDB proxy")
        world.start_proxy()
        log(f"LokaDB proxy on port {world.proxy_port} (pid {world.proxy.pid}), "
            f"RSS {world.proxy_rss_at_start} KiB")
        log("start PgBouncer")
        world.start_pgbouncer()
        log(f"PgBouncer on port {world.bouncer_port} (pid {world.bouncer.pid}), "
            f"RSS {world.bouncer_rss_at_start} KiB")
        meta["ports"] = {"postgres": world.pg_port, "lokadb": world.proxy_port, "pgbouncer": world.bouncer_port}

        bench = Bench(world, mode, world.tmp)
        meta["scripts"] = {k: v.format(rows=mode.rows, orgs=ORGS) for k, v in SCRIPTS.items()}

        log("warm-up")
        for t in TARGETS:
            for qm in QUERY_MODES:
                bench.pgbench(phase="warmup", kind="warmup", scenario=f"warmup read {qm}", script="read",
                                  qmode=qm, target=t, clients=32, threads=2,
                                  seconds=mode.t_warmup)

        for rep in range(mode.reps):
            order = rotated(rep)
            log(f"repetition {rep + 1}/{mode.reps}, target order {order}")
            for script in SCRIPTS:
                for qm in QUERY_MODES:
                    for kind, clients, threads, secs in (
                        ("latency", 1, 1, mode.t_latency),
                        ("throughput", 32, 2, mode.t_throughput),
                    ):
                        sc = f"{script} {qm} c{clients}"
                        for t in order:
                            bench.pgbench(phase="measure", kind=kind, scenario=sc, script=script, qmode=qm,
                                              target=t, clients=clients, threads=threads,
                                              seconds=secs, rep=rep)
            sc = "read simple, connect per txn"
            for t in order:
                bench.pgbench(phase="measure", kind="connect", scenario=sc, script="read", qmode="simple",
                                  target=t, clients=16, threads=2, seconds=mode.t_connect,
                                  connect_each=True, rep=rep)

        log(f"idle clients: {mode.idle_clients} through each proxy")
        # PgBouncer first: LokaDB's upstream pool keeps its cloud backends after the clients leave.
        for t in ["pgbouncer", "lokadb"]:
            try:
                res = idle_clients_test(world, t, mode.idle_clients)
            except Exception as e:
                res = {"target": t, "error": repr(e), "requested_clients": mode.idle_clients,
                       "opened_clients": 0, "rss_kib_idle_before": rss_kib(world.pid_of(t)),
                       "rss_kib_with_clients": -1, "rss_kib_after_close": -1,
                       "pg_backends_with_clients": None, "connect_seconds": None}
            res["rss_kib_at_start"] = world.proxy_rss_at_start if t == "lokadb" else world.bouncer_rss_at_start
            raw["idle_clients"].append(res)
            log(f"  {t}: RSS {res['rss_kib_idle_before']} KiB idle -> {res['rss_kib_with_clients']} KiB "
                f"with {res['opened_clients']} clients ({res.get('rss_kib_per_idle_client')} KiB/client), "
                f"{res.get('pg_backends_with_clients')} Postgres backends; {res.get('error', 'ok')}")
            if res.get("error"):
                meta["errors"].append(f"idle clients via {t}: {res['error']}")
        meta["alive_at_end"] = world.alive()
        meta["proxy_stderr_tail"] = world.proxy_stderr.read_text(errors="replace")[-4000:]
        bl = world.tmp / "pgbouncer.log"
        meta["pgbouncer_log_tail"] = bl.read_text(errors="replace")[-3000:] if bl.exists() else ""
    except KeyboardInterrupt as e:
        log(f"interrupted ({e}); cleaning up")
        meta["errors"].append(f"interrupted: {e}")
        exit_code = 130
    except Exception as e:
        log(f"FAILED: {e}")
        meta["errors"].append(f"fatal: {e}\n{traceback.format_exc()}")
        exit_code = 1
        if world is not None and getattr(world, "proxy_stderr", None) and world.proxy_stderr.exists():
            meta["proxy_stderr_tail"] = world.proxy_stderr.read_text(errors="replace")[-4000:]
    finally:
        ignore_signals()
        safe_cleanup()

    meta["duration_seconds"] = round(time.time() - t_start, 1)
    meta["finished_utc"] = dt.datetime.now(dt.timezone.utc).isoformat()
    if bench is not None:
        raw["runs"] = bench.runs
        meta["errors"].extend(bench.events)
        for r in bench.runs:
            if r["phase"] == "measure" and r.get("error"):
                meta["errors"].append(f"{r['scenario']} via {r['target']} (rep {r['rep']}): {r['error']}"
                                      + (f" — {r['first_error']}" if r.get("first_error") else ""))
    summary = summarize(raw["runs"], mode.reps) if raw["runs"] else {}
    raw["summary"] = summary
    (outdir / "raw.json").write_text(json.dumps(raw, indent=2, default=str))
    if summary and exit_code == 0:
        md = render_proxy_core(raw, outdir, not args.no_charts_data)
        print()
        print(md)
    log(f"results in {outdir} ({meta['duration_seconds']} s)")
    return exit_code


def render_proxy_core(raw: dict, outdir: Path, charts_data: bool) -> str:
    """run.py's outputs of a run's raw numbers: the charts, summary.md and, if charts_data, its
    charts-data.md section; returns the markdown."""
    meta, summary = raw["meta"], raw["summary"]
    charts = draw_charts(outdir, summary, raw["idle_clients"], f" ({meta['mode']} mode, run {meta['run_id']})")
    md = summary_markdown(meta, summary, raw["idle_clients"])
    (outdir / "summary.md").write_text(md)
    if charts_data:
        pooled = " transaction-pooling" if meta.get("lokadb_pool_mode") == "transaction" else ""
        update_charts_data(charts_data_section(meta, summary, raw["idle_clients"], outdir, charts),
                           meta["mode"] + pooled)
    return md


if __name__ == "__main__":
    sys.exit(main())
