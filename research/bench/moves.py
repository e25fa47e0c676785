#!/usr/bin/env python3
"""LokaDB move benchmark: `lokadb move-org` / `lokadb move-back` under writers, through a 40 ms link.

    /work/main/.venv/bin/python research/bench/moves.py [--quick] [--out DIR]

For each scenario (organization size x catch-up mode x writers) a fresh world: a cloud cluster
with the test schema of tests/tests/it/admin_enable.rs (`SCHEMA`), bulk rows for organizations 1
and 2 in the DEFAULT partitions (`lokadb enable documents`, `lokadb enable document_versions`),
organization 2's database registered behind the relay (`lokadb org add 2 --via-relay ...`), the
relay, and organization 2's agent dialing the relay's agent port through the latency link (20 ms
each way = 40 ms RTT). Writers (psycopg threads, straight at the cloud) insert documents and
versions of organizations 1 and 2 before, during and after `lokadb move-org 2 [--mode M]`; then
the rows are counted on both sides, the link's ceiling is measured on the same rows (a plain COPY
through the relay), and once per size `lokadb move-back 2` is measured too.

The world of a size is built once and its two data directories kept as templates; each scenario
starts clusters on copies of them (`cp -a`), so each move is a first move (a split out of DEFAULT).
With --split-ahead, `lokadb split 2` runs first under the same writers (measured like a move: its
pause, the others' longest wait), and the move-org that follows has no split.

Writes raw.json, summary.md and PNG charts into research/bench/results/<UTC ts>-moves[-quick]/
and the numbers behind the charts into research/bench/charts-data.md (move-org sections).
Benchmarks whatever binaries are in $LOKADB_BENCH_TARGET (default /work/target-bench/release,
built with `CARGO_TARGET_DIR=/work/target-bench cargo build --release -p lokadb -p lokadb-agent
-p lokadb-tests`); it builds nothing. See research/bench/README.md, "Move benchmark".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lib.binaries import AGENT_BIN, BIN_DIR, LINK_BIN, LOKADB_BIN, PG_BIN, bin_dir_of, binary_info  # noqa: E402
from lib.charts import GOAL_STYLE, REFERENCE_STYLE, goal_line, marks, save_png  # noqa: E402
from lib.clusters import (  # noqa: E402
    APP_PASSWORD, BODY_BYTES, CLOUD_PG, ORG, ORG_DB, ORG_PG, OTHER, TABLES, PgCluster, cluster_root, load_sql,
    lokadb, mask, org_database, schema_sql,
)
from lib.numbers import fmt  # noqa: E402
from lib.procs import (  # noqa: E402
    CHILDREN, CLK_TCK, catch_signals, cpu_ticks, loadavg, log, preflight, proc_status, temp_dir, ticks_to_ms,
    tree_ticks,
)
from lib.relay import prepare_tunnel, start_link, start_tunnel, stop_agents, tunnel_agent, tunnel_relay  # noqa: E402
from lib.results import (  # noqa: E402
    Ctx, git_info, guarded_run, machine_info, rerender, result_dir, write_charts_section, write_outputs,
)
from lib.writers import Writers  # noqa: E402

import psycopg  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402  (lib set the Agg backend)

RTT_MS = 40.0
GOAL_PAUSE_MS = 300

LOGICAL_CLOUD_PG = {"wal_level": "logical", "wal_writer_delay": "10ms"}


class Mode:
    def __init__(self, quick: bool):
        self.quick = quick
        self.name = "quick" if quick else "full"
        self.sizes_mb = [20] if quick else [60, 600]
        self.modes = ["trigger"] if quick else ["trigger", "logical"]
        self.writers = [2] if quick else [2, 8]
        self.t_before = 3.0 if quick else 5.0  # writers' seconds before the move
        self.t_after = 2.0 if quick else 3.0  # ... and after it
        self.move_back = True  # once per size, after the first scenario
        self.move_back_writers = 2
        # Organization 1's rows in DEFAULT as a multiple of organization 2's (the one moved).
        self.default_factor = 1
        # Extra arguments of every move-org and move-back (e.g. ["--part-size", "1GB"]).
        self.move_args: list[str] = []
        # `lokadb split 2` (measured, under the same writers) before each move-org, which then
        # has no split.
        self.split_ahead = False


# --------------------------------------------------------------------------------------
# The world of one size


def org_pairs(size_mb: int) -> int:
    """Documents (one version each) of one organization for ~size_mb MB of COPY text."""
    return int(size_mb * 1e6 / (BODY_BYTES + 45))


def build_template(ctx, size_mb: int) -> dict:
    """Cloud + organization clusters for one size, stopped: their data dirs are the templates."""
    root = cluster_root(ctx.tmp / f"template-{size_mb}")
    info = {"size_mb_target": size_mb, "pairs_per_org": org_pairs(size_mb), "timings_s": {}}
    T = info["timings_s"]
    t0 = time.time()
    org = PgCluster(root, "org", ctx.commands).create(ORG_PG)
    info["postgres_version"] = org_database(org)
    relay = tunnel_relay(ctx, ORG, f"relay-template-{size_mb}")
    agent = tunnel_agent(ctx, relay.agents_port, org.addr())
    cloud = PgCluster(root, "cloud", ctx.commands)
    try:
        relay.wait_connected(1)
        cloud.create(CLOUD_PG)
        with cloud.conn() as c:
            c.execute("CREATE DATABASE app")
        dsn = cloud.dsn()
        T["clusters"] = round(time.time() - t0, 1)
        t = time.time()
        lokadb(ctx, ["init"], dsn)
        with cloud.conn("app") as c:
            c.execute(schema_sql())
        T["init_schema"] = round(time.time() - t, 1)
        t = time.time()
        info["default_factor"] = ctx.mode.default_factor
        sql = load_sql(info["pairs_per_org"], ctx.mode.default_factor)
        ctx.commands.append(f"(cloud, database app) {sql.strip()}")
        with cloud.conn("app") as c:
            c.execute(sql)
            c.execute("VACUUM ANALYZE documents")
            c.execute("VACUUM ANALYZE document_versions")
        T["load"] = round(time.time() - t, 1)
        log(f"  loaded {2 * info['pairs_per_org']:,} documents + versions in {T['load']} s")
        t = time.time()
        for tbl in TABLES:
            lokadb(ctx, ["enable", tbl], dsn)
        T["enable"] = round(time.time() - t, 1)
        log(f"  lokadb enable documents, document_versions: {T['enable']} s")
        t = time.time()
        lokadb(ctx, ["org", "add", ORG, "--via-relay", f"127.0.0.1:{ctx.relay_pg_port}", "--dbname",
                     ORG_DB, "--user", "app", "--password", APP_PASSWORD], dsn)
        T["org_add"] = round(time.time() - t, 1)
        with cloud.conn("app") as c:
            c.execute("VACUUM ANALYZE")
            c.execute("CHECKPOINT")
            rows = {}
            for tbl in TABLES:
                rows[tbl] = dict(c.execute(
                    f"SELECT organization_id::text, count(*) FROM {tbl} GROUP BY 1 ORDER BY 1").fetchall())
            info["rows"] = rows
            # The COPY text of organization 2's rows (what a move streams), and on disk.
            t = time.time()
            copy_bytes = {}
            for tbl in TABLES:
                n = 0
                with c.cursor().copy(f"COPY (SELECT * FROM {tbl} WHERE organization_id = {ORG}) TO STDOUT") as cp:
                    for data in cp:
                        n += len(data)
                copy_bytes[tbl] = n
            info["org_copy_bytes"] = copy_bytes
            info["org_copy_mb"] = round(sum(copy_bytes.values()) / 1e6, 1)
            T["measure_copy"] = round(time.time() - t, 1)
            info["cloud_db_size_mb"] = round(c.execute("SELECT pg_database_size('app')").fetchone()[0] / 1e6, 1)
            info["default_partition_mb"] = {
                tbl: round(c.execute(f"SELECT pg_total_relation_size('{tbl}__lokadb_default')").fetchone()[0] / 1e6, 1)
                for tbl in TABLES}
        log(f"  organization {ORG}: {info['org_copy_mb']} MB of COPY text "
            f"({rows['documents'].get(ORG)} documents, {rows['document_versions'].get(ORG)} versions); "
            f"cloud database {info['cloud_db_size_mb']} MB")
    finally:
        stop_agents([agent])
        relay.stop()
        cloud.stop()
        org.stop()
    info["cloud_template"] = cloud.data
    info["org_template"] = org.data
    info["template_du_mb"] = {
        n: round(int(subprocess.run(["du", "-sk", str(p)], capture_output=True, text=True).stdout.split()[0]) / 1024, 1)
        for n, p in (("cloud", cloud.data), ("org", org.data))}
    T["total"] = round(time.time() - t0, 1)
    return info


# --------------------------------------------------------------------------------------
# The move command and its report


def run_move(ctx, args: list, dsn: str, timeout=3600) -> dict:
    """Runs lokadb with `args`, timestamping every output line; CPU and peak RSS from wait4."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOKADB_")}
    env.update({"LOKADB_CLOUD": dsn, "LOKADB_LOG": "warn"})
    cmd = [str(LOKADB_BIN), *args]
    ctx.commands.append(mask(f"LOKADB_CLOUD='{dsn}' " + shlex.join(cmd)))
    lines: list = []
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                         env=env, start_new_session=True, text=True)
    CHILDREN.append(p)

    def pump(stream, name):
        for line in stream:
            lines.append((time.monotonic() - t0, name, line.rstrip("\n")))

    pumps = [threading.Thread(target=pump, args=(p.stdout, "stdout"), daemon=True),
             threading.Thread(target=pump, args=(p.stderr, "stderr"), daemon=True)]
    for th in pumps:
        th.start()
    killer = threading.Timer(timeout, lambda: p.poll() is None and p.kill())
    killer.start()
    # Peak RSS from /proc (VmHWM), sampled: wait4's ru_maxrss would include the forked Python
    # image from before the exec.
    hwm = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            v = proc_status(p.pid).get("VmHWM")
            if v:
                hwm[0] = max(hwm[0], v)
            done.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        _, status, ru = os.wait4(p.pid, 0)
    finally:
        killer.cancel()
        done.set()
    t1 = time.monotonic()
    p.returncode = os.waitstatus_to_exitcode(status)
    for th in pumps:
        th.join(timeout=10)
    if p in CHILDREN:
        CHILDREN.remove(p)
    lines.sort()
    return {"command": mask(shlex.join(cmd)), "rc": p.returncode, "wall_s": round(t1 - t0, 3),
            "t0": t0, "t1": t1, "cpu_user_s": round(ru.ru_utime, 3), "cpu_sys_s": round(ru.ru_stime, 3),
            "vmhwm_kib": hwm[0], "ru_maxrss_kib_incl_fork": ru.ru_maxrss,
            "lines": [{"t": round(t, 3), "stream": s, "line": l} for t, s, l in lines]}


def parse_report(res: dict) -> dict:
    out = {"copied": [], "verify": [], "switch_retries": 0, "split_retries": 0}
    for e in res["lines"]:
        line, t = e["line"], e["t"]
        if m := re.search(r"split of \S+: its writes paused (\d+) ms", line):
            out["split_pause_ms"] = int(m.group(1))
            out["t_split_pause_end"] = t
        elif m := re.search(r"split (\S+): (\d+) rows copied to", line):
            out.setdefault("split_rows", {})[m.group(1)] = int(m.group(2))
        elif m := re.search(r"split of \S+ out of DEFAULT done in ([\d.]+) s", line):
            out["split_s"] = float(m.group(1))
            out["t_split_done"] = t
        elif re.search(r"prepared \d+ (tables|cloud partitions)", line):
            out["t_prepared"] = t
        elif m := re.search(r"copied (\S+): (\d+) rows, ([\d.]+) MB in ([\d.]+) s", line):
            out["copied"].append({"table": m.group(1), "rows": int(m.group(2)), "mb": float(m.group(3)),
                                  "s": float(m.group(4)), "t": t})
        elif m := re.search(r"initial copy by the subscription done in ([\d.]+) s", line):
            out["subscription_copy_s"] = float(m.group(1))
            out["t_copy_done"] = t
        elif m := re.search(r"subscription caught up after ([\d.]+) s \(a marker arrives in (\d+) ms\)", line):
            out["catchup_s"] = float(m.group(1))
            out["marker_ms"] = int(m.group(2))
            out["t_catchup_done"] = t
        elif m := re.search(r"catch-up done: (\d+) records in ([\d.]+) s", line):
            out["catchup_records"] = int(m.group(1))
            out["catchup_s"] = float(m.group(2))
            out["t_catchup_done"] = t
        elif m := re.search(r"switched \S+ to (its database|the cloud): its writes paused (\d+) ms "
                            r"\((\d+) last records applied in (\d+) ms\)", line):
            out["switch_pause_ms"] = int(m.group(2))
            out["switch_last_records"] = int(m.group(3))
            out["switch_apply_ms"] = int(m.group(4))
            out["t_switch"] = t
        elif line.startswith("lokadb: verify "):
            out["verify"].append(line[len("lokadb: verify "):])
        elif "lock not granted" in line and "switch of" in line:
            out["switch_retries"] += 1
        elif "DEFAULT partition's lock was not granted" in line:
            out["split_retries"] += 1
        elif m := re.search(r"(move-org|move-back) of \S+ done in ([\d.]+) s(?:, writes paused (\d+) ms at the switch)?; verified", line):
            out["done_s"] = float(m.group(2))
            out["final_pause_ms"] = int(m.group(3)) if m.group(3) else None
            out["final_line"] = line
    # Phase durations from the lines' timestamps (s since the command started).
    marks = [("split", out.get("t_split_done")), ("prepare", out.get("t_prepared")),
             ("copy", out.get("t_copy_done") if "t_copy_done" in out else
              (max(c["t"] for c in out["copied"]) if out["copied"] else None)),
             ("catch-up", out.get("t_catchup_done")), ("switch", out.get("t_switch")),
             ("verify", max((e["t"] for e in res["lines"] if e["line"].startswith("lokadb: verify ")), default=None)),
             ("clean-up", res["wall_s"])]
    phases, prev = {}, 0.0
    for name, t in marks:
        if t is not None:
            phases[name] = round(t - prev, 2)
            prev = t
    out["phases_s"] = phases
    out["verified"] = bool(out["verify"]) and all("checksum equal" in v for v in out["verify"]) \
        and not any("DIFFERS" in v for v in out["verify"]) and "final_line" in out
    if out["copied"]:
        out["copy_mb"] = round(sum(c["mb"] for c in out["copied"]), 1)
        out["copy_rows"] = sum(c["rows"] for c in out["copied"])
        # Tables copy in parallel: the copy phase is from the end of "prepare" to the last table.
        t_start = out.get("t_prepared")
        t_end = max(c["t"] for c in out["copied"])
        out["copy_phase_s"] = round(t_end - t_start, 2) if t_start is not None else max(c["s"] for c in out["copied"])
        out["copy_mb_s"] = round(out["copy_mb"] / max(1e-6, out["copy_phase_s"]), 2)
        out["t_copy_done"] = t_end
    return out


# --------------------------------------------------------------------------------------
# Counting and the link's ceiling


def count_state(cloud: PgCluster, org: PgCluster) -> dict:
    out = {}
    with cloud.conn("app") as c:
        for tbl in TABLES:
            for o in (OTHER, ORG):
                out[f"cloud_{tbl}_org{o}"] = c.execute(
                    f"SELECT count(*) FROM {tbl} WHERE organization_id = {o}").fetchone()[0]
            out[f"cloud_default_{tbl}_org{ORG}"] = c.execute(
                f"SELECT count(*) FROM ONLY {tbl}__lokadb_default WHERE organization_id = {ORG}").fetchone()[0]
        out["cloud_org_parts_c"] = c.execute(
            f"SELECT count(*) FROM pg_class WHERE relname LIKE '%\\_\\_lokadb\\_{ORG}\\_c'").fetchone()[0]
        out["cloud_org_parts_f"] = c.execute(
            f"SELECT count(*) FROM pg_class WHERE relname LIKE '%\\_\\_lokadb\\_{ORG}\\_f'").fetchone()[0]
        out["state"] = c.execute(f"SELECT state FROM lokadb.org WHERE id = '{ORG}'").fetchone()[0]
        out["moves_in_journal"] = c.execute("SELECT count(*) FROM lokadb.moves").fetchone()[0]
        out["slots"] = c.execute("SELECT count(*) FROM pg_replication_slots").fetchone()[0]
        out["publications"] = c.execute("SELECT count(*) FROM pg_publication").fetchone()[0]
    with org.conn(ORG_DB) as c:
        for tbl in TABLES:
            exists = c.execute(f"SELECT to_regclass('public.{tbl}') IS NOT NULL").fetchone()[0]
            out[f"org_has_{tbl}"] = exists
            if exists:
                out[f"org_{tbl}_org{ORG}"] = c.execute(
                    f"SELECT count(*) FROM public.{tbl} WHERE organization_id = {ORG}").fetchone()[0]
                out[f"org_{tbl}_others"] = c.execute(
                    f"SELECT count(*) FROM public.{tbl} WHERE organization_id <> {ORG}").fetchone()[0]
        out["org_subscriptions"] = c.execute("SELECT count(*) FROM pg_subscription").fetchone()[0]
    return out


def check_moved(before: dict, after: dict, ok: dict) -> dict:
    ok1, ok2 = ok.get("1", 0), ok.get("2", 0)
    checks = {}
    for tbl in TABLES:
        checks[f"org {ORG} {tbl} in its database = before + its inserts"] = (
            after.get(f"org_{tbl}_org{ORG}"), before[f"cloud_{tbl}_org{ORG}"] + ok2)
        checks[f"org {ORG} {tbl} through the cloud (postgres_fdw) = in its database"] = (
            after[f"cloud_{tbl}_org{ORG}"], after.get(f"org_{tbl}_org{ORG}"))
        checks[f"org {OTHER} {tbl} in the cloud = before + its inserts"] = (
            after[f"cloud_{tbl}_org{OTHER}"], before[f"cloud_{tbl}_org{OTHER}"] + ok1)
        checks[f"org {ORG} {tbl} rows left in DEFAULT"] = (after[f"cloud_default_{tbl}_org{ORG}"], 0)
        checks[f"other organizations' {tbl} rows in org {ORG}'s database"] = (after.get(f"org_{tbl}_others"), 0)
    checks[f"org {ORG} cloud partitions (__lokadb_{ORG}_c) left"] = (after["cloud_org_parts_c"], 0)
    checks["state"] = (after["state"], "moved")
    checks["journal rows left"] = (after["moves_in_journal"], 0)
    checks["replication slots left"] = (after["slots"], 0)
    checks["publications left"] = (after["publications"], 0)
    checks["subscriptions left"] = (after["org_subscriptions"], 0)
    return {k: {"got": g, "want": w, "ok": g == w} for k, (g, w) in checks.items()}


def check_back(before: dict, after: dict, ok: dict) -> dict:
    ok1, ok2 = ok.get("1", 0), ok.get("2", 0)
    checks = {}
    for tbl in TABLES:
        checks[f"org {ORG} {tbl} in the cloud = before + its inserts"] = (
            after[f"cloud_{tbl}_org{ORG}"], before[f"cloud_{tbl}_org{ORG}"] + ok2)
        checks[f"org {OTHER} {tbl} in the cloud = before + its inserts"] = (
            after[f"cloud_{tbl}_org{OTHER}"], before[f"cloud_{tbl}_org{OTHER}"] + ok1)
        checks[f"org {ORG}'s database still has {tbl}"] = (after[f"org_has_{tbl}"], False)
    checks[f"org {ORG} foreign partitions (__lokadb_{ORG}_f) left"] = (after["cloud_org_parts_f"], 0)
    checks["state"] = (after["state"], "cloud")
    checks["journal rows left"] = (after["moves_in_journal"], 0)
    return {k: {"got": g, "want": w, "ok": g == w} for k, (g, w) in checks.items()}


def relay_conn(ctx):
    return psycopg.connect(host="127.0.0.1", port=ctx.relay_pg_port, user="app", password=APP_PASSWORD,
                           dbname=f"{ORG}/{ORG_DB}", sslmode="disable", autocommit=True, connect_timeout=30)


def parallel(fns) -> list:
    res = [None] * len(fns)

    def one(i, f):
        try:
            res[i] = f()
        except Exception as e:  # noqa: BLE001
            res[i] = e

    ths = [threading.Thread(target=one, args=(i, f), daemon=True) for i, f in enumerate(fns)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    for r in res:
        if isinstance(r, Exception):
            raise r
    return res


def ceilings(ctx, org: PgCluster) -> dict:
    """The same rows (organization 2's tables in its database, after the move) as plain COPYs,
    both tables at once as the move copies them:
      read  — COPY TO STDOUT from the org database through the relay + link (org → cloud side)
      write — COPY FROM STDIN through the relay + link into a table with the destination's columns
              and indexes (cloud side → org: the move's direction), fed by a COPY read from the
              org database directly
      write_direct — the same write straight into the org database (no relay, no link)."""
    out = {}

    def read_one(tbl):
        t0 = time.monotonic()
        n = 0
        with relay_conn(ctx) as c:
            with c.cursor().copy(f"COPY (SELECT * FROM public.{tbl}) TO STDOUT") as cp:
                for data in cp:
                    n += len(data)
        return n, time.monotonic() - t0

    def write_one(tbl, through_relay: bool):
        dst_name = f"lokadb_bench_ceiling_{tbl}"
        with org.conn(ORG_DB, user="app", password=APP_PASSWORD) as c:
            c.execute(f"DROP TABLE IF EXISTS public.{dst_name}")
            c.execute(f"CREATE TABLE public.{dst_name} (LIKE public.{tbl} INCLUDING DEFAULTS INCLUDING INDEXES)")
        t0 = time.monotonic()
        n = 0
        src = org.conn(ORG_DB, user="app", password=APP_PASSWORD)
        dst = relay_conn(ctx) if through_relay else org.conn(ORG_DB, user="app", password=APP_PASSWORD)
        try:
            with src.cursor().copy(f"COPY (SELECT * FROM public.{tbl}) TO STDOUT") as cin, \
                    dst.cursor().copy(f"COPY public.{dst_name} FROM STDIN") as cout:
                buf = bytearray()
                for data in cin:
                    buf += data
                    if len(buf) >= 1 << 20:
                        cout.write(buf)
                        n += len(buf)
                        buf = bytearray()
                if buf:
                    cout.write(buf)
                    n += len(buf)
        finally:
            src.close()
            dst.close()
        secs = time.monotonic() - t0
        with org.conn(ORG_DB, user="app", password=APP_PASSWORD) as c:
            c.execute(f"DROP TABLE public.{dst_name}")
        return n, secs

    for kind, fn in (("read", lambda t: read_one(t)),
                     ("write", lambda t: write_one(t, True)),
                     ("write_direct", lambda t: write_one(t, False))):
        t0 = time.monotonic()
        c0 = cpu_ticks(ctx.relay.pid), cpu_ticks(ctx.agent.pid)
        res = parallel([(lambda t=t: fn(t)) for t in TABLES])
        wall = time.monotonic() - t0
        c1 = cpu_ticks(ctx.relay.pid), cpu_ticks(ctx.agent.pid)
        total = sum(r[0] for r in res)
        out[kind] = {"bytes": total, "seconds": round(wall, 3), "mb_s": round(total / wall / 1e6, 2),
                     "per_table": {t: {"bytes": r[0], "seconds": round(r[1], 3)} for t, r in zip(TABLES, res)},
                     "relay_cpu_ms": ticks_to_ms(c1[0] - c0[0]), "agent_cpu_ms": ticks_to_ms(c1[1] - c0[1]),
                     "loadavg_before": loadavg()}
        log(f"    ceiling {kind:<12} {total / 1e6:8.1f} MB in {wall:6.1f} s = {total / wall / 1e6:6.1f} MB/s")
    return out


# --------------------------------------------------------------------------------------
# One scenario


def proc_snapshot(ctx) -> dict:
    s = {"relay": cpu_ticks(ctx.relay.pid), "agent": cpu_ticks(ctx.agent.pid),
         "link_agent": cpu_ticks(ctx.link.proc.pid),
         "cloud_pg": tree_ticks(ctx.cloud.proc.pid), "org_pg": tree_ticks(ctx.org.proc.pid)}
    if ctx.link_sub is not None:
        s["link_subscription"] = cpu_ticks(ctx.link_sub.proc.pid)
    r = resource.getrusage(resource.RUSAGE_SELF)
    s["bench_python"] = int((r.ru_utime + r.ru_stime) * CLK_TCK)
    return s


def cpu_delta(a: dict, b: dict) -> dict:
    return {k: (round(ticks_to_ms(b[k] - a[k]), 0) if a.get(k) is not None and b.get(k) is not None else None)
            for k in a}


def relay_bytes(ctx) -> dict:
    try:
        return ctx.relay.stats()
    except Exception:  # noqa: BLE001
        return {}


def measured_move(ctx, label: str, args: list, n_writers: int, tag: str) -> dict:
    """Writers for t_before, the command, writers for t_after; returns the record."""
    mode = ctx.mode
    rec = {"label": label, "writers": n_writers, "loadavg_before": loadavg()}
    before = count_state(ctx.cloud, ctx.org)
    rec["counts_before"] = before
    wr = Writers(ctx.cloud, n_writers, tag)
    t_start = time.monotonic()
    wr.start()
    try:
        time.sleep(1.0 + mode.t_before)
        st0, cpu0 = relay_bytes(ctx), proc_snapshot(ctx)
        log(f"    {label}: {mask(shlex.join(args))} ({n_writers} writers)")
        res = run_move(ctx, args, ctx.cloud.dsn())
        cpu1, st1 = proc_snapshot(ctx), relay_bytes(ctx)
        time.sleep(mode.t_after)
    finally:
        t_stop = time.monotonic()
        wr.finish()
    rec["move"] = {k: v for k, v in res.items() if k not in ("t0", "t1")}
    rec["report"] = parse_report(res)
    rec["cpu_ms"] = cpu_delta(cpu0, cpu1)
    rec["cpu_ms"]["lokadb"] = round((res["cpu_user_s"] + res["cpu_sys_s"]) * 1e3, 0)
    rec["relay_stats_delta"] = {k: st1.get(k, 0) - st0.get(k, 0) for k in
                                ("bytes_to_agents", "bytes_from_agents", "streams_opened") if k in st1}
    rec["writers_tally"] = wr.tally(res["t0"], res["t1"], t_start, t_stop)
    rec["loadavg_after"] = loadavg()
    after = count_state(ctx.cloud, ctx.org)
    rec["counts_after"] = after
    rep = rec["report"]
    w = rec["writers_tally"]
    log(f"    rc={res['rc']} in {res['wall_s']:.1f} s; split pause {rep.get('split_pause_ms')} ms, "
        f"switch pause {rep.get('switch_pause_ms')} ms, copy {rep.get('copy_mb')} MB at {rep.get('copy_mb_s')} MB/s; "
        f"lokadb CPU {rec['cpu_ms']['lokadb']:.0f} ms; writers ok {w['ok']} errors {w['errors']}")
    if res["rc"] != 0:
        tail = "\n".join(e["line"] for e in res["lines"][-15:])
        ctx.errors.append(f"{label}: {res['command']} exited {res['rc']}: {tail}")
        log("    FAILED:\n" + tail)
    return rec


def scenario(ctx, tpl: dict, size_mb: int, mode_name: str, n_writers: int, move_back: bool) -> dict:
    label = f"{size_mb} MB, {mode_name}, {n_writers} writers"
    rec = {"size_mb_target": size_mb, "mode": mode_name, "writers": n_writers, "label": label,
           "org_copy_mb": tpl["org_copy_mb"]}
    root = cluster_root(ctx.tmp / f"run-{len(ctx.runs)}")
    ctx.cloud = PgCluster(root, "cloud", ctx.commands)
    ctx.org = PgCluster(root, "org", ctx.commands)
    ctx.relay = ctx.agent = ctx.link = ctx.link_sub = None
    t0 = time.time()
    try:
        ctx.cloud.clone_from(tpl["cloud_template"])
        ctx.org.clone_from(tpl["org_template"])
        rec["clone_s"] = round(time.time() - t0, 1)
        logical = mode_name == "logical"
        trace = {"log_min_duration_statement": "0", "log_line_prefix": "%m [%p] %a: "} if ctx.trace_admin else {}
        ctx.cloud.start({**CLOUD_PG, **(LOGICAL_CLOUD_PG if logical else {}), **trace})
        ctx.org.start({**ORG_PG, **trace})
        if logical:
            with ctx.org.conn() as c:
                c.execute("ALTER ROLE app SUPERUSER")
        rec["cloud_settings"] = ctx.cloud.settings
        rec["org_settings"] = ctx.org.settings
        start_tunnel(ctx, ORG, "relay-run", RTT_MS)
        args = ["move-org", ORG, "--mode", mode_name, *ctx.mode.move_args]
        if logical:
            # The subscription (the org database dialing the cloud) crosses a link of the same
            # 40 ms RTT, as it would from the organization's site.
            ctx.link_sub = start_link(ctx.cloud.port, RTT_MS / 2, ctx.tmp, ctx.commands)
            # A REPLICATION role, not a superuser: move-org refuses to store the latter in
            # the organization's database.
            with ctx.cloud.conn() as c:
                c.execute("CREATE ROLE lokadb_sub LOGIN REPLICATION PASSWORD 'sub-secret'")
            args += ["--cloud-from-org",
                     f"host=127.0.0.1 port={ctx.link_sub.port} user=lokadb_sub password=sub-secret "
                     "dbname=app sslmode=disable"]
        rec["setup_s"] = round(time.time() - t0, 1)
        if ctx.mode.split_ahead:
            sa = measured_move(ctx, f"{label}: split ahead", ["split", ORG], n_writers, f"s{len(ctx.runs)}")
            rec["split_ahead"] = sa
            if sa["move"]["rc"] != 0:
                raise RuntimeError(f"lokadb split {ORG} exited {sa['move']['rc']}")
        m = measured_move(ctx, label, args, n_writers, f"r{len(ctx.runs)}")
        rec["move_org"] = m
        checks = check_moved(m["counts_before"], m["counts_after"], m["writers_tally"]["ok"])
        rec["checks"] = checks
        bad = [f"{k}: got {v['got']}, want {v['want']}" for k, v in checks.items() if not v["ok"]]
        if bad:
            ctx.errors.append(f"{label}: checks failed: " + "; ".join(bad))
            log("    CHECKS FAILED: " + "; ".join(bad))
        else:
            log(f"    checks: all {len(checks)} passed")
        if m["move"]["rc"] == 0:
            t = time.time()
            rec["ceiling"] = ceilings(ctx, ctx.org)
            rec["ceiling_s"] = round(time.time() - t, 1)
            if move_back:
                mb = measured_move(ctx, f"{label}: move-back", ["move-back", ORG, *ctx.mode.move_args], ctx.mode.move_back_writers,
                                   f"b{len(ctx.runs)}")
                rec["move_back"] = mb
                cb = check_back(mb["counts_before"], mb["counts_after"], mb["writers_tally"]["ok"])
                mb["checks"] = cb
                bad = [f"{k}: got {v['got']}, want {v['want']}" for k, v in cb.items() if not v["ok"]]
                if bad:
                    ctx.errors.append(f"{label} move-back: checks failed: " + "; ".join(bad))
                    log("    MOVE-BACK CHECKS FAILED: " + "; ".join(bad))
                else:
                    log(f"    move-back checks: all {len(cb)} passed")
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{e!r}"
        rec["traceback"] = traceback.format_exc()
        ctx.errors.append(f"{label}: {e!r}")
        log(f"    SCENARIO FAILED: {e!r}")
        traceback.print_exc()
        for c in (ctx.cloud, ctx.org):
            rec[f"{c.name}_log_tail"] = c.log_tail()
    finally:
        if ctx.agent is not None:
            stop_agents([ctx.agent])
        for lk in (ctx.link_sub, ctx.link):
            if lk is not None:
                lk.stop()
        if ctx.relay is not None:
            rec["relay_stderr_tail"] = ctx.relay.stderr_path.read_text(errors="replace")[-1500:]
            ctx.relay.stop()
        errs = [line for c in (ctx.cloud, ctx.org) for line in c.log_tail(200000).splitlines()
                if " ERROR: " in line or "FATAL:" in line or "PANIC:" in line]
        if ctx.trace_admin:
            # Every statement of lokadb's own sessions (application_name 'lokadb admin'), with
            # millisecond timestamps and durations: where a pause's time goes.
            trace_dir = ctx.outdir / f"admin-statements-run{len(ctx.runs)}"
            trace_dir.mkdir(exist_ok=True)
            for c in (ctx.cloud, ctx.org):
                keep = [line for line in c.log_tail(1 << 31).splitlines() if "lokadb admin" in line]
                (trace_dir / f"{c.name}.log").write_text("\n".join(keep) + "\n")
            rec["admin_statements_dir"] = str(trace_dir)
        rec["postgres_log_errors"] = errs[-40:]
        rec["postgres_log_error_count"] = len(errs)
        ctx.cloud.stop()
        ctx.org.stop()
        shutil.rmtree(root, ignore_errors=True)
        rec["wall_s"] = round(time.time() - t0, 1)
    return rec


# --------------------------------------------------------------------------------------
# Summary


def row_of(r: dict, which="move_org") -> dict:
    m = r.get(which) or {}
    rep = m.get("report") or {}
    w = m.get("writers_tally") or {}
    ceil = r.get("ceiling") or {}
    copy_mb = rep.get("copy_mb")
    copy_s = rep.get("copy_phase_s")
    if r["mode"] == "logical" and which == "move_org":
        copy_mb = r["org_copy_mb"]  # the subscription's copy: the rows' COPY text, measured at setup
        copy_s = rep.get("subscription_copy_s")
    mb_s = round(copy_mb / copy_s, 2) if copy_mb and copy_s else None
    total = rep.get("done_s") or (m.get("move") or {}).get("wall_s")
    read = (ceil.get("read") or {}).get("mb_s")
    write = (ceil.get("write") or {}).get("mb_s")
    cpu = (m.get("cpu_ms") or {}).get("lokadb")
    errs = w.get("errors") or {}
    checks = (r.get("checks") if which == "move_org" else m.get("checks")) or {}
    ahead = ((r.get("split_ahead") or {}).get("report") or {}) if which == "move_org" else {}
    return {
        "split_ahead_pause_ms": ahead.get("split_pause_ms"),
        "split_ahead_longest_org1_ms": (((r.get("split_ahead") or {}).get("writers_tally") or {})
                                        .get("longest_org1") or {}).get("ms") if ahead else None,
        "label": r["label"] + (" — move-back" if which == "move_back" else ""),
        "size_mb": r["size_mb_target"], "org_copy_mb": r["org_copy_mb"],
        "mode": r["mode"] if which == "move_org" else "trigger (move-back)",
        "writers": w.get("writers", r["writers"]),
        "rc": (m.get("move") or {}).get("rc"),
        "split_pause_ms": rep.get("split_pause_ms"), "switch_pause_ms": rep.get("switch_pause_ms"),
        "total_s": total, "copy_mb": copy_mb, "copy_s": copy_s, "copy_mb_s": mb_s,
        "overall_mb_s": round(copy_mb / total, 2) if copy_mb and total else None,
        "ceiling_read_mb_s": read, "ceiling_write_mb_s": write,
        "ceiling_write_direct_mb_s": (ceil.get("write_direct") or {}).get("mb_s"),
        "ratio_read": round(mb_s / read, 2) if mb_s and read else None,
        "ratio_write": round(mb_s / write, 2) if mb_s and write else None,
        "catchup_records": rep.get("catchup_records"), "catchup_s": rep.get("catchup_s"),
        "marker_ms": rep.get("marker_ms"), "split_s": rep.get("split_s"),
        "switch_retries": rep.get("switch_retries"),
        "lokadb_cpu_ms": cpu, "lokadb_cpu_ms_per_mb": round(cpu / copy_mb, 1) if cpu and copy_mb else None,
        "lokadb_maxrss_kib": (m.get("move") or {}).get("vmhwm_kib"),
        "cpu_ms": m.get("cpu_ms"),
        "relay_to_org_mb": round((m.get("relay_stats_delta") or {}).get("bytes_to_agents", 0) / 1e6, 1)
        if (m.get("relay_stats_delta") or {}).get("bytes_to_agents") is not None else None,
        "relay_from_org_mb": round((m.get("relay_stats_delta") or {}).get("bytes_from_agents", 0) / 1e6, 1)
        if (m.get("relay_stats_delta") or {}).get("bytes_from_agents") is not None else None,
        "before": ((w.get("rate") or {}).get("before") or {}).get("all"),
        "during": ((w.get("rate") or {}).get("during") or {}).get("all"),
        "after": ((w.get("rate") or {}).get("after") or {}).get("all"),
        "during_org1": ((w.get("rate") or {}).get("during") or {}).get("org1"),
        "during_org2": ((w.get("rate") or {}).get("during") or {}).get("org2"),
        "after_org1": ((w.get("rate") or {}).get("after") or {}).get("org1"),
        "after_org2": ((w.get("rate") or {}).get("after") or {}).get("org2"),
        "org2_p50_after_ms": (((w.get("latency_after") or {}).get("org2")) or {}).get("p50_ms"),
        "phases": rep.get("phases_s") or {},
        "longest_org2_ms": (w.get("longest_org2") or {}).get("ms"),
        "longest_org1_ms": (w.get("longest_org1") or {}).get("ms"),
        "ok": w.get("ok"), "errors": errs,
        "verified": rep.get("verified"),
        "checks_ok": all(c["ok"] for c in checks.values()) if checks else None,
        "checks_failed": [k for k, c in checks.items() if not c["ok"]],
    }


def summarize(raw: dict) -> dict:
    rows = []
    for r in raw.get("runs", []):
        for which in ("move_org", "move_back"):
            m = r.get(which)
            if m and (m.get("move") or {}).get("lines") is not None:
                m["report"] = parse_report(m["move"])  # (again: a --render picks up parser changes)
        if r.get("move_org"):
            rows.append(row_of(r, "move_org"))
        if r.get("move_back"):
            rows.append(row_of(r, "move_back"))
    return {"rows": rows}


def err_cell(errs: dict) -> str:
    if not errs:
        return "0"
    return ", ".join(f"{k} ×{v}" for k, v in sorted(errs.items()))


def split_cell(r: dict) -> str:
    """The split's pause; with --split-ahead, the move-org's (none) and that of `lokadb split` before it."""
    if r.get("split_ahead_pause_ms") is not None:
        return f"{fmt(r['split_pause_ms'])} ms (split ahead: {fmt(r['split_ahead_pause_ms'])} ms)"
    return f"{fmt(r['split_pause_ms'])} ms"


def tables_md(raw: dict, s: dict) -> list[str]:
    L = ["| size (org 2 COPY MB) | mode | writers | split pause | switch pause | total | copy MB | copy MB/s | "
         "link read ceiling | ÷ read ceiling | link write ceiling | ÷ write ceiling | inserts/s before / during / after | "
         "org-2 longest wait | writer errors | verified + checks |",
         "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|"]
    for r in s["rows"]:
        ver = "yes" if r["verified"] and r["checks_ok"] else (
            f"verified={fmt(r['verified'])}, checks={fmt(r['checks_ok'])}" + (
                f" ({'; '.join(r['checks_failed'])})" if r["checks_failed"] else ""))
        if r["rc"] not in (0, None):
            ver = f"**FAILED (rc {r['rc']})**"
        L.append(
            f"| {r['size_mb']} ({fmt(r['org_copy_mb'])}) | {r['mode']} | {r['writers']} | "
            f"{split_cell(r)} | **{fmt(r['switch_pause_ms'])} ms** | {fmt(r['total_s'])} s | "
            f"{fmt(r['copy_mb'])} | {fmt(r['copy_mb_s'])} | {fmt(r['ceiling_read_mb_s'])} | {fmt(r['ratio_read'], 2)} | "
            f"{fmt(r['ceiling_write_mb_s'])} | {fmt(r['ratio_write'], 2)} | "
            f"{fmt(r['before'], 0)} / {fmt(r['during'], 0)} / {fmt(r['after'], 0)} | {fmt(r['longest_org2_ms'], 0)} ms | "
            f"{err_cell(r['errors'])} | {ver} |")
    L += ["", "Pauses as `lokadb` reports them (from taking the organization's lock to the commit). "
          "Split = the first move's pause out of DEFAULT; switch = the pause at the switch (goal ≤ 300 ms). "
          "copy MB/s: trigger mode and move-back = bytes `lokadb` reports copied ÷ the copy phase (end of "
          "\"prepared\" to the last table copied, tables in parallel); logical mode = organization 2's rows' COPY "
          "text (measured at setup) ÷ the subscription's initial copy time. Link ceilings: the same rows after the "
          "move as plain COPYs through the relay and the 40 ms link, both tables at once — read = COPY TO STDOUT "
          "from the org database (the org → cloud direction, as move-back), write = COPY FROM STDIN into a table "
          "with the destination's columns and indexes (the cloud → org direction, as move-org). "
          "Writers' inserts/s count committed transactions (a document + a version) of both organizations. "
          "Org-2 longest wait: the longest transaction of organization 2, committed or rolled back (a 40001 at the "
          "split waited through the split's pause).", ""]
    L += ["### Phases, CPU and writers per scenario", "",
          "| scenario | phases (s, from the command's output timestamps) | catch-up | marker | lokadb CPU | lokadb CPU ms/MB | lokadb peak RSS | "
          "relay / agent / link CPU | cloud / org Postgres CPU | relay bytes to / from the org (MB) | inserts/s during: org 1 / org 2 | after: org 1 / org 2 (org-2 p50) | org-1 longest txn |",
          "|---|---|---|---:|---:|---:|---:|---|---|---|---:|---|---:|"]
    for r in s["rows"]:
        c = r["cpu_ms"] or {}
        cu = (f"{fmt(r['catchup_records'], 0)} records in {fmt(r['catchup_s'])} s" if r["catchup_records"] is not None
              else (f"{fmt(r['catchup_s'])} s" if r["catchup_s"] is not None else "—"))
        ph = " · ".join(f"{k} {v:.1f}" for k, v in r["phases"].items())
        L.append(
            f"| {r['label']} | {ph} | {cu} | {fmt(r['marker_ms'], 0)} ms | "
            f"{fmt(r['lokadb_cpu_ms'], 0)} ms | {fmt(r['lokadb_cpu_ms_per_mb'])} | "
            f"{fmt(r['lokadb_maxrss_kib'] / 1024 if r['lokadb_maxrss_kib'] else None, 1)} MiB | {fmt(c.get('relay'), 0)} / {fmt(c.get('agent'), 0)} / "
            f"{fmt(c.get('link_agent'), 0)}" + (f" (+ {fmt(c.get('link_subscription'), 0)} subscription link)" if c.get("link_subscription") is not None else "")
            + f" ms | {fmt(c.get('cloud_pg'), 0)} / {fmt(c.get('org_pg'), 0)} ms | "
            f"{fmt(r['relay_to_org_mb'])} / {fmt(r['relay_from_org_mb'])} | "
            f"{fmt(r['during_org1'], 0)} / {fmt(r['during_org2'], 0)} | {fmt(r['after_org1'], 0)} / {fmt(r['after_org2'], 0)} "
            f"({fmt(r['org2_p50_after_ms'], 0)} ms) | {fmt(r['longest_org1_ms'], 0)} ms |")
    L.append("")
    return L


def summary_markdown(raw: dict, s: dict) -> str:
    m = raw["meta"]
    L = [f"# Move benchmark, {m['mode']} mode — run {m['run_id']}", "",
         f"Commit `{m['git']['commit'][:12]}`{' (dirty tree)' if m['git']['dirty'] else ''}, "
         f"{m['machine']['nproc']} cores (shared), load average at start {m['machine']['loadavg_at_start']}, "
         f"{m.get('wall_seconds', 0):.0f} s in all. Binaries: `{bin_dir_of(m, BIN_DIR)}`. "
         f"Command: `{m['command'].strip()}`.", "",
         f"World: PostgreSQL 18 clusters (cloud and organization 2's), relay, organization 2's agent dialing the "
         f"relay through the latency link ({RTT_MS / 2:g} ms each way = {RTT_MS:g} ms RTT); the move reaches the org "
         f"database through the relay's Postgres listener. Logical mode: the subscription dials the cloud through a "
         f"second link of the same RTT. Writers: psycopg threads straight at the cloud, {m['mode_settings']['t_before']} s "
         f"before and {m['mode_settings']['t_after']} s after the command.", ""]
    L.append("## Sizes\n")
    L.append("| size | documents + versions per org | org 2 COPY text | cloud database | template build (load / enable) |")
    L.append("|---|---:|---:|---:|---|")
    for size, t in (raw.get("templates") or {}).items():
        if not isinstance(t, dict) or "rows" not in t:
            continue
        T = t["timings_s"]
        L.append(f"| {size} MB | {fmt(t['rows']['documents'].get(ORG))} + {fmt(t['rows']['document_versions'].get(ORG))} "
                 f"| {fmt(t['org_copy_mb'])} MB | {fmt(t['cloud_db_size_mb'])} MB | {fmt(T.get('total'))} s "
                 f"({fmt(T.get('load'))} / {fmt(T.get('enable'))} s) |")
    L.append("")
    if m.get("scaling_note"):
        L += [m["scaling_note"], ""]
    L.append("## Results\n")
    L += tables_md(raw, s)
    errs = [r for r in s["rows"] if r["errors"]]
    if errs or raw["meta"]["errors"]:
        L.append("## Errors\n")
        for r in s["rows"]:
            run = next((x for x in raw["runs"] if x["label"] == r["label"].replace(" — move-back", "")), {})
            which = "move_back" if "move-back" in r["label"] else "move_org"
            msgs = ((run.get(which) or {}).get("writers_tally") or {}).get("error_messages") or {}
            for k, v in msgs.items():
                L.append(f"- {r['label']}: writers {k} — {v}")
        for e in raw["meta"]["errors"]:
            L.append(f"- {e}")
        L.append("")
    L.append("Raw numbers, every command, the move's timestamped output and per-second writer counts: `raw.json.gz`. "
             "Method: `research/bench/README.md`, \"Move benchmark\".\n")
    return "\n".join(L)


# The reference's pauses of a move under writers, 43 ms from the cloud (shared/seed/
# performance-reference.txt, "Moving an organization under writes"; RESULTS.md's overview and
# section "Moves"): at the switch, by size and mode, 1.74 s (trigger, 2 writers) and 1.66 s
# (logical, 8 writers) at 60 MB, 2.32 s and 3.26 s at 600 MB; the split (the first move, out of
# DEFAULT) about 6 s at 60 MB and about a minute at 600 MB. Drawn over the move-org rows of the
# same size and mode (not move-back's).
REFERENCE_SWITCH_MS = {(60, "trigger"): 1740, (60, "logical"): 1660, (600, "trigger"): 2320, (600, "logical"): 3260}
REFERENCE_SPLIT_MS = {60: 6000, 600: 60000}
# The goals (RESULTS.md's overview, rows "Moves"): split and switch pause ≤ 0.3 s (GOAL_PAUSE_MS);
# the copy ≥ 0.8 × the link's write ceiling (issue 23).
GOAL_COPY_OVER_WRITE_CEILING = 0.8


def draw_charts(outdir: Path, raw: dict, s: dict) -> list[str]:
    made = []
    rows = s["rows"]
    if not rows:
        return made
    names = [r["label"].replace(", ", "\n").replace(" — ", "\n") for r in rows]
    x = list(range(len(rows)))
    run_of = f"{raw['meta']['mode']} mode, run {raw['meta']['run_id']}"
    # 1. pauses vs the goal and the reference (log scale: ours 0.1–10 s, the reference's up to a minute)
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(rows) + 2), 4.8))
    sp = [r["split_pause_ms"] for r in rows]
    sw = [r["switch_pause_ms"] for r in rows]
    ax.bar([i - 0.2 for i in x], [v or float("nan") for v in sp], 0.4, label="split out of DEFAULT (first move)",
           color="#8b949e")
    ax.bar([i + 0.2 for i in x], [v or float("nan") for v in sw], 0.4, label="switch", color="#1f6feb")
    for i in x:
        if sp[i] is not None:
            ax.text(i - 0.2, sp[i], f"{sp[i]:,}", ha="center", va="bottom", fontsize=7)
        if sw[i] is not None:
            ax.text(i + 0.2, sw[i], f"{sw[i]:,}", ha="center", va="bottom", fontsize=7)
    ref_split = [REFERENCE_SPLIT_MS.get(r["size_mb"]) if r["mode"] in ("trigger", "logical") else None for r in rows]
    ref_switch = [REFERENCE_SWITCH_MS.get((r["size_mb"], r["mode"])) for r in rows]
    marks(ax, [i - 0.2 for i in x], ref_split, 0.4,
          "reference, split: ≈ " + ", ".join(f"{v / 1000:g} s at {k} MB" for k, v in REFERENCE_SPLIT_MS.items()
                                              if v in ref_split),
          {**REFERENCE_STYLE, "colors": "#24292f"})
    marks(ax, [i + 0.2 for i in x], ref_switch, 0.4,
          "reference, switch: " + ", ".join(f"{v / 1000:g} s ({m}, {k} MB)"
                                            for (k, m), v in REFERENCE_SWITCH_MS.items() if v in ref_switch),
          REFERENCE_STYLE)
    goal_line(ax, GOAL_PAUSE_MS, f"≤ {GOAL_PAUSE_MS} ms, split and switch")
    ax.set_yscale("log")
    ax.set_xticks(x, names, fontsize=7)
    ax.set_ylabel("writes paused, ms (log)")
    ax.set_title(f"Pauses of lokadb move-org / move-back at {RTT_MS:g} ms RTT\n({run_of})", fontsize=10)
    # Room above the tallest figure for the legend.
    ax.set_ylim(top=max(v for v in sp + sw + ref_split + ref_switch + [GOAL_PAUSE_MS] if v) * 15)
    ax.legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    save_png(fig, outdir / "moves-pause.png", 110)
    plt.close(fig)
    made.append("moves-pause.png")
    # 2. MB/s vs the link's ceilings
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(rows) + 2), 4.8))
    series = [("copy_mb_s", "move: copy phase", "#1f6feb"), ("overall_mb_s", "move: MB ÷ total time", "#79c0ff"),
              ("ceiling_write_mb_s", "plain COPY → org via relay + link", "#d29922"),
              ("ceiling_read_mb_s", "plain COPY ← org via relay + link", "#8b949e")]
    w = 0.2
    for j, (k, lab, col) in enumerate(series):
        vals = [r[k] for r in rows]
        xs = [i + (j - 1.5) * w for i in x]
        ax.bar(xs, [v or 0 for v in vals], w, label=lab, color=col)
        for xx, v in zip(xs, vals):
            if v is not None:
                ax.text(xx, v, f"{v:.0f}", ha="center", va="bottom", fontsize=6)
    # The goal over each row's copy bar: 0.8 × that run's write ceiling.
    marks(ax, [i - 1.5 * w for i in x],
          [GOAL_COPY_OVER_WRITE_CEILING * r["ceiling_write_mb_s"]
           if r["ceiling_write_mb_s"] and r["mode"] in ("trigger", "logical") else None for r in rows],
          w, f"goal: move-org's copy ≥ {GOAL_COPY_OVER_WRITE_CEILING:g} × the write ceiling",
          GOAL_STYLE)
    ax.set_xticks(x, names, fontsize=7)
    ax.set_ylabel("MB/s")
    ax.set_title(f"Move throughput vs the link's ceiling, {RTT_MS:g} ms RTT\n({run_of})", fontsize=10)
    ax.set_ylim(top=max([r[k] for r in rows for k, *_ in series if r[k]] + [1]) * 1.6)
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    fig.tight_layout()
    save_png(fig, outdir / "moves-throughput.png", 110)
    plt.close(fig)
    made.append("moves-throughput.png")
    # 3. writers per second around each move
    recs = []
    for r in raw.get("runs", []):
        for which in ("move_org", "move_back"):
            m = r.get(which)
            if m and (m.get("writers_tally") or {}).get("per_second"):
                recs.append((r["label"] + (" — move-back" if which == "move_back" else ""), m))
    if recs:
        n = len(recs)
        cols = 2 if n > 1 else 1
        nrows = math.ceil(n / cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 2.6 * nrows), squeeze=False)
        for k, (lab, m) in enumerate(recs):
            ax = axes[k // cols][k % cols]
            ps = m["writers_tally"]["per_second"]
            # Each writer alternates the organizations: their rates are equal by construction.
            tot = [a + b for a, b in zip(ps["org1"], ps["org2"])]
            ax.step(ps["t"], tot, where="post", label="commits/s (org 1 + org 2)", color="#1f6feb")
            if any(ps["errors"]):
                ax.step(ps["t"], ps["errors"], where="post", label="errors/s", color="#a33")
            ax.set_yscale("symlog", linthresh=10)
            rep = m["report"]
            ax.axvline(0, color="k", lw=0.8, ls=":")
            ax.axvline(m["move"]["wall_s"], color="k", lw=0.8, ls=":")
            if rep.get("t_split_pause_end") is not None:
                ax.axvline(rep["t_split_pause_end"], color="#d29922", lw=1, label="split pause")
            if rep.get("t_switch") is not None:
                ax.axvline(rep["t_switch"], color="#a33", lw=1, label="switch")
            ax.set_title(lab, fontsize=8)
            ax.set_xlabel("s from the command's start", fontsize=7)
            ax.set_ylabel("commits/s (symlog)", fontsize=7)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=6)
        for k in range(n, nrows * cols):
            axes[k // cols][k % cols].axis("off")
        fig.suptitle(f"Writers' commits per second around each move, {RTT_MS:g} ms RTT ({run_of})", fontsize=9)
        fig.tight_layout()
        save_png(fig, outdir / "moves-writers.png", 100)
        plt.close(fig)
        made.append("moves-writers.png")
    return made


def update_charts_data(raw: dict, s: dict, outdir: Path, charts: list[str]) -> None:
    m = raw["meta"]
    mode = m["mode"]
    rel = f"results/{outdir.name}"
    body = [f"## move-org, {mode} mode" + (" — ~20 MB, one scenario; indicative only" if mode == "quick" else ""), "",
            f"Run `{outdir.name}` (folder `{rel}/`), commit `{m['git']['commit'][:12]}`"
            f"{' (dirty tree)' if m['git']['dirty'] else ''}, {m['machine']['nproc']} cores, written by "
            f"`research/bench/moves.py` (`{m['command'].strip()}`). Charts: " + ", ".join(f"`{rel}/{c}`" for c in charts) + ".", ""]
    body += ["### moves-pause.png — writes paused (ms); goal 300 ms", "",
             "| scenario | split (first move, out of DEFAULT) | switch |", "|---|---:|---:|"]
    for r in s["rows"]:
        body.append(f"| {r['label']} | {fmt(r['split_pause_ms'])} | {fmt(r['switch_pause_ms'])} |")
    body += ["", "### moves-throughput.png — MB/s", "",
             "| scenario | copy phase | MB ÷ total time | plain COPY → org via relay + link | plain COPY ← org via relay + link | plain COPY → org, no relay | copy ÷ read ceiling | copy ÷ write ceiling |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in s["rows"]:
        body.append(f"| {r['label']} | {fmt(r['copy_mb_s'])} | {fmt(r['overall_mb_s'])} | {fmt(r['ceiling_write_mb_s'])} | "
                    f"{fmt(r['ceiling_read_mb_s'])} | {fmt(r['ceiling_write_direct_mb_s'])} | {fmt(r['ratio_read'], 2)} | {fmt(r['ratio_write'], 2)} |")
    body += ["", "### moves-writers.png — writers' commits per second (both organizations)", "",
             "| scenario | before | during | after | org 1 during | org 2 during | errors |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in s["rows"]:
        body.append(f"| {r['label']} | {fmt(r['before'], 0)} | {fmt(r['during'], 0)} | {fmt(r['after'], 0)} | "
                    f"{fmt(r['during_org1'], 0)} | {fmt(r['during_org2'], 0)} | {err_cell(r['errors'])} |")
    write_charts_section(f"move-org {mode}", "\n".join(body).rstrip("\n"))


# --------------------------------------------------------------------------------------


def render(raw: dict, outdir: Path, charts_data: bool) -> str:
    s = summarize(raw)
    raw["summary"] = s
    return write_outputs(raw, s, outdir, charts_data, summary_markdown, draw_charts, update_charts_data)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~20 MB, 2 writers, trigger mode only (a few minutes)")
    ap.add_argument("--out", type=Path, help="result folder (default results/<UTC ts>-moves[-quick]); "
                                             "a trial run: charts-data.md is left alone")
    ap.add_argument("--sizes", help="comma-separated organization sizes in MB (default: quick 20, full 60,600)")
    ap.add_argument("--modes", help="comma-separated: trigger,logical")
    ap.add_argument("--writers", help="comma-separated writer counts (default: quick 2, full 2,8)")
    ap.add_argument("--no-move-back", action="store_true", help="skip the move-back measurement")
    ap.add_argument("--default-factor", type=int, default=1,
                    help="organization 1's rows in DEFAULT as a multiple of organization 2's (default 1; "
                         "20 for the issue's 'DEFAULT at least 20 times the organization')")
    ap.add_argument("--move-args", default="",
                    help="extra arguments of every move-org and move-back, e.g. '--part-size 1GB' "
                         "(one copy stream per table, as before copies in parts)")
    ap.add_argument("--split-ahead", action="store_true",
                    help="run `lokadb split 2` under the writers before each move-org (measured: its own pause), "
                         "so that the move-org has no split")
    ap.add_argument("--no-charts-data", action="store_true", help="leave charts-data.md alone")
    ap.add_argument("--trace-admin", action="store_true",
                    help="diagnostic: both clusters log every statement with its duration; the lines of "
                         "lokadb's own sessions are kept in admin-statements-run<N>/ of the result folder "
                         "(the logging costs time: not for the measured runs)")
    ap.add_argument("--render", type=Path, help="only rebuild summary.md, charts and charts-data.md from this raw.json or raw.json.gz")
    args = ap.parse_args()
    if args.render:
        return rerender(args.render, render, not args.no_charts_data)
    preflight("moves.py", (PG_BIN / "postgres", LOKADB_BIN, AGENT_BIN, LINK_BIN))
    mode = Mode(args.quick)
    if args.sizes:
        mode.sizes_mb = [int(x) for x in args.sizes.split(",")]
    if args.modes:
        mode.modes = args.modes.split(",")
    if args.writers:
        mode.writers = [int(x) for x in args.writers.split(",")]
    if args.no_move_back:
        mode.move_back = False
    if not 1 <= args.default_factor <= 1000:
        ap.error("--default-factor must be 1 to 1000")
    mode.default_factor = args.default_factor
    mode.move_args = shlex.split(args.move_args)
    mode.split_ahead = args.split_ahead
    started, run_id, outdir = result_dir(args.out, "-moves", mode.quick)
    catch_signals()

    ctx = Ctx(mode)
    ctx.outdir = outdir
    ctx.trace_admin = args.trace_admin
    ctx.runs = []
    meta = {"run_id": run_id, "mode": mode.name, "started_utc": started.isoformat(),
            "command": ("/work/main/.venv/bin/python research/bench/moves.py " + shlex.join(sys.argv[1:])).strip(),
            "mode_settings": dict(vars(mode)), "rtt_ms": RTT_MS, "body_bytes": BODY_BYTES,
            "machine": machine_info(), "git": git_info(),
            "binaries": {b.name: binary_info(b) for b in (LOKADB_BIN, AGENT_BIN, LINK_BIN)},
            "postgres_settings": {"cloud": CLOUD_PG, "cloud_logical_extra": LOGICAL_CLOUD_PG, "org": ORG_PG,
                                  "fsync": "on (default)"},
            "env": {"LOKADB_MUX_*": "unset (defaults: 4 MiB window, no auto-tuning)"},
            "trace_admin": args.trace_admin,
            "setup_commands": ctx.commands, "errors": ctx.errors}
    raw = {"meta": meta, "templates": {}, "runs": ctx.runs}

    def body():
        ctx.tmp = temp_dir("lokadb-moves-bench-")
        prepare_tunnel(ctx, ORG)
        log(f"mode={mode.name} sizes={mode.sizes_mb} MB modes={mode.modes} writers={mode.writers} out={outdir}")
        for size in mode.sizes_mb:
            log(f"size {size} MB: building the world (cloud + organization clusters), kept as templates")
            tpl = build_template(ctx, size)
            raw["templates"][str(size)] = tpl
            first = True
            for mname in mode.modes:
                for nw in mode.writers:
                    log(f"  scenario {size} MB, {mname}, {nw} writers (load average {loadavg()})")
                    rec = scenario(ctx, tpl, size, mname, nw, move_back=first and mode.move_back)
                    first = False
                    ctx.runs.append(rec)
                    log(f"  scenario done in {rec['wall_s']} s")
                    (outdir / "raw.json").write_text(json.dumps(raw, indent=1, default=str))
            shutil.rmtree(Path(tpl["cloud_template"]).parent.parent, ignore_errors=True)
        failed = any(r.get("error") or (r.get("move_org") or {}).get("move", {}).get("rc") for r in ctx.runs)
        return 1 if failed else 0

    return guarded_run(ctx, raw, outdir, render, not args.no_charts_data and not args.out, body)


if __name__ == "__main__":
    sys.exit(main())
