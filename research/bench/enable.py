#!/usr/bin/env python3
"""`lokadb enable` of a large table under writers: how long it takes, whom it makes wait and
for how long, the writers' throughput and errors, and whether every row and key is there after.

    LOKADB_BENCH_TARGET=/work/main/target/release .venv/bin/python research/bench/enable.py [--quick] [--rows N] [--writers N]

A cloud cluster (PostgreSQL 18, moves.py's settings) with the test schema of
tests/tests/it/admin_enable.rs, `documents` bulk-loaded with N rows of organizations 1 and 2
(full: 10,000,000; quick: 1,000,000), then W writers (full and quick: 8; psycopg threads
straight at the cloud, moves.py's: a document and a version of organization 1 or 2 per
transaction) for a few seconds before, during and after `lokadb enable documents`. The
command's output is timestamped line by line, so its phases show (the swap, the key map
backfill with its progress lines, the foreign keys). At the end: documents before + inserted =
documents after, and the key map holds every document's key.

Writes raw.json and summary.md into research/bench/results/<UTC ts>-enable[-quick]/.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lib.binaries import LOKADB_BIN, PG_BIN  # noqa: E402
from lib.clusters import CLOUD_PG, PgCluster, cluster_root, lokadb, mask, schema_sql  # noqa: E402
from lib.numbers import fmt  # noqa: E402
from lib.procs import catch_signals, log, preflight, temp_dir  # noqa: E402
from lib.results import Ctx, git_info, guarded_run, machine_info, rerender, result_dir  # noqa: E402
from lib.writers import Writers  # noqa: E402  (moves.py's writers)


class Mode:
    def __init__(self, quick: bool, rows: int | None, writers: int | None):
        self.quick = quick
        self.name = "quick" if quick else "full"
        self.rows = rows or (1_000_000 if quick else 10_000_000)
        self.writers = writers or 8
        self.t_before = 5.0
        self.t_after = 5.0


def load_sql(rows: int) -> str:
    # Triggers off for the bulk load: the rows are consistent by construction.
    return f"""
SET session_replication_role = replica;
INSERT INTO documents (organization_id, project_id, title)
  SELECT 1 + g % 2, 10 * (1 + g % 2), 'bulk ' || g FROM generate_series(1, {rows}) g;
SET session_replication_role = origin;
"""


def timed_enable(ctx, dsn: str) -> dict:
    """Runs `lokadb enable documents`, each output line with its second since the start."""
    env = {"LOKADB_CLOUD": dsn, "LOKADB_LOG": "warn", "PATH": "/usr/bin:/bin"}
    cmd = [str(LOKADB_BIN), "enable", "documents"]
    ctx.commands.append(mask(f"LOKADB_CLOUD='{dsn}' " + shlex.join(cmd)))
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list = []

    def pump(stream, name):
        for line in stream:
            lines.append((round(time.monotonic() - t0, 2), name, line.rstrip()))

    threads = [threading.Thread(target=pump, args=(p.stdout, "out"), daemon=True),
               threading.Thread(target=pump, args=(p.stderr, "err"), daemon=True)]
    for t in threads:
        t.start()
    rc = p.wait(timeout=7200)
    for t in threads:
        t.join(timeout=10)
    return {"rc": rc, "seconds": round(time.monotonic() - t0, 2), "lines": sorted(lines)}


def measure(ctx) -> dict:
    mode = ctx.mode
    root = cluster_root(ctx.tmp / "world")
    cloud = PgCluster(root, "cloud", ctx.commands).create(CLOUD_PG)
    rec: dict = {"rows": mode.rows, "writers": mode.writers}
    try:
        with cloud.conn() as c:
            c.execute("CREATE DATABASE app")
        dsn = cloud.dsn()
        lokadb(ctx, ["init"], dsn)
        t = time.time()
        with cloud.conn("app") as c:
            c.execute(schema_sql())
            sql = load_sql(mode.rows)
            ctx.commands.append(f"(cloud, database app) {sql.strip()}")
            c.execute(sql)
            c.execute("VACUUM ANALYZE documents")
        rec["load_s"] = round(time.time() - t, 1)
        rec["table_mb"] = round(cloud.one("SELECT pg_total_relation_size('documents')") / 1e6, 1)
        docs_before = cloud.one("SELECT count(*) FROM documents")
        log(f"{mode.rows:,} rows loaded in {rec['load_s']} s ({rec['table_mb']} MB with indexes); "
            f"{mode.writers} writers, then lokadb enable documents")
        w = Writers(cloud, mode.writers, "enable")
        t_start = time.monotonic()
        w.start()
        time.sleep(mode.t_before)
        t0 = time.monotonic()
        rec["enable"] = timed_enable(ctx, dsn)
        t1 = time.monotonic()
        time.sleep(mode.t_after)
        t_stop = time.monotonic()
        w.finish()
        rec["writers_tally"] = w.tally(t0, t1, t_start, t_stop)
        inserted = sum(int(v) for v in rec["writers_tally"]["ok"].values())
        docs_after = cloud.one("SELECT count(*) FROM documents")
        keys = cloud.one("SELECT count(*) FROM lokadb.km_documents_id")
        rec["checks"] = {
            "enable exit status 0": rec["enable"]["rc"] == 0,
            f"documents: {docs_before} before + {inserted} inserted = {docs_after} after":
                docs_before + inserted == docs_after,
            f"key map: {keys} keys for {docs_after} documents": keys == docs_after,
        }
    finally:
        cloud.stop()
    return rec


def summary_markdown(raw: dict) -> str:
    m = raw["meta"]
    out = [f"# lokadb enable under writers — run {m['run_id']}", "",
           f"Commit `{m['git'].get('commit', '?')[:12]}`{' (dirty tree)' if m['git'].get('dirty') else ''}, "
           f"{m.get('wall_seconds', '?')} s, load average at the end {m.get('loadavg_at_end', '?')}. "
           f"Command: `{m['command']}`.", ""]
    r = raw.get("run")
    if not r or "enable" not in r:
        return "\n".join(out + ["No run completed.", ""] + [f"- {e[:2000]}" for e in m["errors"]]) + "\n"
    t = r["writers_tally"]
    lat = t["latency_during_move"]
    worst = max((t.get(k) or {} for k in ("longest_org1", "longest_org2")), key=lambda x: x.get("ms") or 0)
    longest = f"{worst.get('ms')} (ended {worst.get('ended_at_s')} s into the command)"
    rate = t["rate"]
    errs = ", ".join(f"{k} ×{v}" for k, v in t["errors"].items()) or "none"
    out += [
        f"`documents`: {r['rows']:,} rows bulk-loaded ({r['table_mb']} MB with its indexes, {r['load_s']} s); "
        f"{r['writers']} writers (a document and a version per transaction, organizations 1 and 2), "
        f"{raw['meta']['mode_settings']['t_before']} s before and {raw['meta']['mode_settings']['t_after']} s after.", "",
        "| rows | enable | commits/s before / during / after | writers' p50 / p99 / longest during | writer errors | checks |",
        "|---:|---:|---|---|---|---|",
        f"| {r['rows']:,} | {r['enable']['seconds']} s | {fmt(rate['before']['all'], 0)} / {fmt(rate['during']['all'], 0)} / "
        f"{fmt(rate['after']['all'], 0)} | {lat['org1'].get('p50_ms')} / {lat['org1'].get('p99_ms')} / {longest} ms | {errs} | "
        f"{'all pass' if all(r['checks'].values()) else 'FAILED'} |", "",
        "Writers' latency: organization 1's transactions that ended during the command (organization 2's alike); "
        "the longest: of any transaction of the run.", "", "## The command's output, timestamped (s since its start)", "", "```"]
    out += [f"{s:8.2f} {name} {line}" for s, name, line in r["enable"]["lines"]]
    out += ["```", "", "## Checks", ""] + [f"- {'pass' if ok else 'FAIL'}: {k}" for k, ok in r["checks"].items()]
    if m["errors"]:
        out += ["", "## Errors", ""] + [f"- {e[:2000]}" for e in m["errors"]]
    return "\n".join(out) + "\n"


def render(raw: dict, outdir: Path, charts_data: bool) -> str:
    del charts_data  # no chart: one run's table and timeline
    md = summary_markdown(raw)
    (outdir / "summary.md").write_text(md)
    return md


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1,000,000 rows (a few minutes)")
    ap.add_argument("--rows", type=int, help="rows of documents (default: quick 1,000,000, full 10,000,000)")
    ap.add_argument("--writers", type=int, help="writer threads (default 8)")
    ap.add_argument("--out", type=Path, help="result folder (default results/<UTC ts>-enable[-quick])")
    ap.add_argument("--render", type=Path, help="only rebuild summary.md from this raw.json or raw.json.gz")
    args = ap.parse_args()
    if args.render:
        return rerender(args.render, render, False)
    if args.rows is not None and not 1_000 <= args.rows <= 1_000_000_000:
        ap.error("--rows must be 1,000 to 1,000,000,000")
    if args.writers is not None and not 0 <= args.writers <= 64:
        ap.error("--writers must be 0 to 64")
    preflight("enable.py", (PG_BIN / "postgres", LOKADB_BIN))
    mode = Mode(args.quick, args.rows, args.writers)
    started, run_id, outdir = result_dir(args.out, "-enable", mode.quick)
    catch_signals()
    ctx = Ctx(mode)
    meta = {"run_id": run_id, "mode": mode.name, "started_utc": started.isoformat(),
            "command": ("/work/main/.venv/bin/python research/bench/enable.py " + shlex.join(sys.argv[1:])).strip(),
            "mode_settings": dict(vars(mode)), "machine": machine_info(), "git": git_info(),
            "postgres_settings": CLOUD_PG, "setup_commands": ctx.commands, "errors": ctx.errors}
    raw = {"meta": meta}

    def body():
        ctx.tmp = temp_dir("lokadb-enable-bench-")
        raw["run"] = measure(ctx)
        return 0 if all(raw["run"]["checks"].values()) else 1

    return guarded_run(ctx, raw, outdir, render, False, body)


if __name__ == "__main__":
    sys.exit(main())
