"""Two proxies side by side over orgs.py's worlds, one per variant, pgbench through each in turn
in alternating order: statement_org.py's method, also cloud_tls.py's and metrics.py's (their
command line, the run and the summary's table)."""

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from . import orgs_world
from .binaries import BIN_DIR, LOKADB_BIN, PG_BIN, binary_info
from .numbers import fmt, med
from .procs import catch_signals, log, preflight, raise_fd_limit, temp_dir
from .results import Ctx, git_info, guarded_run, machine_info, rerender, result_dir, write_empty_summary, write_summary


def ratio_rows(raw: dict) -> list[str]:
    """The table of a side-by-side run: per script, protocol and N, the first variant's tps
    ÷ the second's (per repetition, median) and both variants' CPU per statement."""
    runs = [r for r in raw["runs"] if r["phase"] == "measure"]
    first, second = list(raw["meta"]["variants"])
    rows = [f"| script | mode | N | tps {first} ÷ {second} | proxy µs/stmt {first} / {second} | "
            f"cloud µs/stmt {first} / {second} |", "|---|---|---:|---:|---:|---:|"]
    cells = sorted({(r["script"], r["query_mode"], r["orgs"]) for r in runs},
                   key=lambda c: (orgs_world.SCRIPTS.index(c[0]), orgs_world.QUERY_MODES.index(c[1]), c[2]))
    for script, qm, n in cells:
        by = {v: [r for r in runs if (r["script"], r["query_mode"], r["orgs"], r["variant"]) == (script, qm, n, v)]
              for v in (first, second)}
        ratios = [a["tps"] / b["tps"] for a, b in zip(by[first], by[second]) if a.get("tps") and b.get("tps")]

        def m_of(v, key):
            xs = [r[key] for r in by[v] if r.get(key) is not None]
            return med(xs) if xs else None
        rows.append(f"| {script} | {qm} | {n:,} | {fmt(med(ratios), 3) if ratios else '—'} | "
                    f"{fmt(m_of(first, 'proxy_us_per_stmt'), 1)} / {fmt(m_of(second, 'proxy_us_per_stmt'), 1)} | "
                    f"{fmt(m_of(first, 'cloud_us_per_stmt'), 0)} / {fmt(m_of(second, 'cloud_us_per_stmt'), 0)} |")
    return rows


def summary(raw: dict, outdir: Path, title: str, variants: str) -> str:
    """summary.md of a side-by-side run: `title`, the run's facts, what the two proxies
    differ in (`variants`, a sentence), the method, and the table of [`ratio_rows`]."""
    if not [r for r in raw["runs"] if r["phase"] == "measure"]:
        return write_empty_summary(raw, outdir, f"{title} benchmark", "measured run")
    m = raw["meta"]
    md = (f"# {title} — run {m['run_id']}\n\n"
          f"Commit `{m['git']['commit'][:12]}`{' (dirty tree)' if m['git']['dirty'] else ''}, "
          f"{m['wall_seconds']} s, load average at the end {m.get('loadavg_at_end')}. "
          f"Command: `{m['command']}`. Cloud: {m.get('postgres_version', '?')}.\n\n"
          f"Two proxies over the same worlds (orgs.py's: N organizations in the cloud), {variants}; "
          f"pgbench {orgs_world.CLIENTS} clients, {m['mode_settings']['seconds']} s per run, "
          f"R = {m['mode_settings']['reps']}, through each in turn (the order alternates). Every "
          f"transaction picks a random organization. Ratios are per repetition, medians over "
          f"repetitions; CPU per statement is the proxy's whole process and the cloud's process "
          f"tree.\n\n" + "\n".join(ratio_rows(raw)) + "\n")
    return write_summary(outdir, md, m["errors"])


def side_by_side(args, ap, *, script: str, tag: str, variants: dict, render, prepare_cloud=None) -> int:
    """Two proxies over the same worlds, one per variant (`db_extra` added to each database,
    `cloud_options` to each `cloud` string), pgbench through each in turn, the order
    alternating; `prepare_cloud(ctx)` runs once the cloud is up; a variant's
    `top_extra` goes to the proxy's top level, and its `during(ctx)`, called as each of
    its runs starts, returns a function called as it ends, whose dict joins the run's
    record."""
    if args.render:
        return rerender(args.render, render, False)
    preflight(script, (PG_BIN / "postgres", PG_BIN / "pgbench", LOKADB_BIN))
    mode = orgs_world.Mode(args.quick)
    mode.orgs = [1000] if args.quick else [1, 1000]
    if args.orgs:
        mode.orgs = [int(n) for n in args.orgs.split(",")]
    # Quick: one repetition of orgs.py's quick 1 s runs (the order still alternates from cell to
    # cell); full: 3 of its 4 s.
    mode.reps = 1 if args.quick else 3
    mode.scripts = args.scripts.split(",")
    mode.query_modes = args.query_modes.split(",")
    if any(qm not in orgs_world.QUERY_MODES for qm in mode.query_modes):
        ap.error(f"--query-modes: each one of {', '.join(orgs_world.QUERY_MODES)}")
    started, run_id, outdir = result_dir(args.out, tag, mode.quick)
    raise_fd_limit()
    catch_signals()
    ctx = Ctx(mode)
    ctx.runs = []
    ctx.proxy = None
    pg_env = f"LOKADB_BENCH_PG_BIN={PG_BIN} " if "LOKADB_BENCH_PG_BIN" in os.environ else ""
    meta = {"run_id": run_id, "mode": mode.name, "started_utc": started.isoformat(),
            "command": pg_env + "LOKADB_BENCH_TARGET=" + str(BIN_DIR) + " .venv/bin/python "
                       f"research/bench/{script} " + shlex.join(sys.argv[1:]),
            "mode_settings": dict(vars(mode)), "machine": machine_info(), "git": git_info(),
            "binaries": {LOKADB_BIN.name: binary_info(LOKADB_BIN)}, "variants": variants,
            "setup_commands": ctx.commands, "errors": ctx.errors}
    raw = {"meta": meta, "worlds": [], "runs": ctx.runs}
    proxies = {}

    def body():
        rc = 0
        ctx.tmp = temp_dir("lokadb-" + tag.strip("-") + "-bench-")
        meta["postgres_version"] = orgs_world.start_cloud(ctx)
        if prepare_cloud:
            prepare_cloud(ctx)
        for n in mode.orgs:
            log(f"building the world of {n} organizations")
            raw["worlds"].append(orgs_world.build_world(ctx, n))
        for v, how in variants.items():
            ctx.proxy = proxies[v] = orgs_world.start_proxy(ctx, how.get("db_extra"), name=f"lokadb-{v}",
                                                            cloud_options=how.get("cloud_options", ""),
                                                            top_extra=how.get("top_extra"))
            orgs_world.wait_metadata(ctx)
            for n in mode.orgs:
                orgs_world.pgbench(ctx, phase="warmup", script="warm", qmode="simple", n=n, target="lokadb",
                                   transactions=1)
        k = 0
        for rep in range(mode.reps):
            for script_name in mode.scripts:
                for qm in mode.query_modes:
                    for n in mode.orgs:
                        order = list(variants) if k % 2 == 0 else list(variants)[::-1]
                        k += 1
                        for v in order:
                            ctx.proxy = proxies[v]
                            during = variants[v].get("during")
                            stop = during(ctx) if during else None
                            r = orgs_world.pgbench(ctx, phase="measure", script=script_name, qmode=qm, n=n,
                                                   target="lokadb", seconds=mode.seconds, rep=rep)
                            if stop:
                                r.update(stop())
                            r["variant"] = v
                            if not r["ok"]:
                                ctx.errors.append(f"{script_name} {qm} N={n} {v}: {r.get('error')}")
                                rc = 1
            (outdir / "raw.json").write_text(json.dumps(raw, indent=1, default=str))
        return rc

    return guarded_run(ctx, raw, outdir, render, False, body)


def arguments(doc: str, quick_help: str) -> tuple:
    """The command line of a side-by-side benchmark: (args, parser)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--out", type=Path, help="result folder (default results/<UTC ts>-<name>[-quick])")
    ap.add_argument("--render", type=Path, help="only rebuild summary.md from this raw.json or raw.json.gz")
    ap.add_argument("--orgs", help="comma-separated organization counts (default: 1000 quick, 1,1000 full)")
    ap.add_argument("--scripts", default="read,update,insert", help="comma-separated orgs.py scripts")
    ap.add_argument("--query-modes", default="simple,extended,prepared",
                    help="comma-separated pgbench protocols (default: all three)")
    return ap.parse_args(), ap
