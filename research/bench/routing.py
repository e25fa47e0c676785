#!/usr/bin/env python3
"""LokaDB routing benchmark: round trips to an organization per operation, fdw vs fdw+direct.

    /work/main/.venv/bin/python research/bench/routing.py [--quick] [--out DIR]

One world (research/bench/README.md, "Routing benchmark"): a cloud cluster with the test schema of
tests/tests/it/admin_enable.rs (as moves.py) and a few thousand rows per organization, organization
2's database behind the relay and its agent, organization 1 staying in the cloud. Organization 2 is
moved once (`lokadb move-org 2 --profile fdw`); its database then logs every statement and every
Parse (`ALTER DATABASE orgdb SET log_statement = 'all'`, `... log_min_duration_statement = 0`). For each RTT (full 0, 10, 40 ms; quick 0, 10)
the relay, a latency link (RTT/2 each way) in front of the relay's agent port, the agent and the
proxy (`lokadb proxy`, with the direct path's login configured) are started afresh; one psycopg
client through the proxy runs each operation N times per profile (fdw, then fdw+direct, switched with
`UPDATE lokadb.org SET profile = ...` in the cloud). Per window of N operations: the statements that
reached organization 2's database (its log, cut by marker statements; round trips from the log's
timestamps at RTT > 0), latency p50/p95 and ÷ RTT, and the proxy's CPU time.

Writes raw.json, summary.md and PNG charts into research/bench/results/<UTC ts>-routing[-quick]/
and the numbers behind the charts into research/bench/charts-data.md ("Routing: round trips to an
organization"). Benchmarks whatever binaries are in $LOKADB_BENCH_TARGET (default
/work/target-bench/release, as moves.py); it builds nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shlex
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lib.binaries import AGENT_BIN, BIN_DIR, LINK_BIN, LOKADB_BIN, PG_BIN, bin_dir_of, binary_info  # noqa: E402
from lib.charts import GOAL_STYLE, REFERENCE_STYLE, marks, save_png  # noqa: E402
from lib.clusters import CLOUD_PG, ORG, ORG_PG, OTHER  # noqa: E402
from lib.numbers import fmt, percentile  # noqa: E402
from lib.procs import (  # noqa: E402
    catch_signals, cpu_ticks, delta, loadavg, log, preflight, rss_kib, sched_ns, temp_dir, ticks_to_ms,
)
from lib.relay import prepare_tunnel, start_tunnel, stop_tunnel  # noqa: E402
from lib.results import (  # noqa: E402
    Ctx, git_info, guarded_run, machine_info, rerender, result_dir, write_charts_section, write_empty_summary,
    write_outputs,
)
from lib.routing_world import (  # noqa: E402
    CLIENT_APP, COUNT_SQL, INSERT_SQL, KEY_SQL, ORG_DB_SETTINGS, ORG_LOG_PREFIX, PROFILES, READ_SQL, READ_SQL_1,
    UPDATE_SQL, OrgLog, analyse, build_world, client, relay_rtt_ms, set_profile, start_proxy,
)

import psycopg  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402  (lib set the Agg backend)


class Mode:
    def __init__(self, quick: bool):
        self.quick = quick
        self.name = "quick" if quick else "full"
        self.rtts_ms = [0, 10] if quick else [0, 10, 40]
        self.n = 15 if quick else 50  # measured operations per window
        # Warm-up per window: more than psycopg's prepare_threshold (5), so the measured
        # operations run psycopg's named prepared statement, as a long-lived application's would.
        self.warmup = 8


# --------------------------------------------------------------------------------------
# Operations (organization 2, point access by the (organization_id, id) index)


class Ops:
    def __init__(self, ids2: list[int], ids1: list[int]):
        self.rng = random.Random(20261204)
        self.ids2, self.ids1 = ids2, ids1
        self.titles = itertools.count(1)

    def doc(self):
        return self.rng.choice(self.ids2)

    def title(self):
        return f"routing bench {next(self.titles)}"  # (organization_id, title) is UNIQUE

    def read(self, c):
        row = c.execute(READ_SQL, (self.doc(),)).fetchone()
        if row is None:
            raise RuntimeError("read: no row")

    def tx_read(self, c):
        with c.transaction():
            row = c.execute(READ_SQL, (self.doc(),)).fetchone()
        if row is None:
            raise RuntimeError("tx_read: no row")

    def tx_update(self, c):
        with c.transaction():
            n = c.execute(UPDATE_SQL, (self.title(), self.doc())).rowcount
        if n != 1:
            raise RuntimeError(f"tx_update: {n} rows")

    def tx_update_insert(self, c):
        d = self.doc()
        with c.transaction():
            n = c.execute(UPDATE_SQL, (self.title(), d)).rowcount
            c.execute(INSERT_SQL, (d, "routing bench audit"))
        if n != 1:
            raise RuntimeError(f"tx_update_insert: {n} rows")

    def update(self, c):
        n = c.execute(UPDATE_SQL, (self.title(), self.doc())).rowcount
        if n != 1:
            raise RuntimeError(f"update: {n} rows")

    def orm_read(self, c):
        d = self.doc()
        row = c.execute(READ_SQL, (d,)).fetchone()
        if row is None:
            raise RuntimeError("orm_read: no row")
        cnt = c.execute(COUNT_SQL, (row[0],)).fetchone()[0]
        if cnt < 1:
            raise RuntimeError(f"orm_read: {cnt} versions")

    def key_read(self, c):
        row = c.execute(KEY_SQL, (self.doc(),)).fetchone()
        if row is None:
            raise RuntimeError("key_read: no row")

    def key_read_1(self, c):
        row = c.execute(KEY_SQL, (self.rng.choice(self.ids1),)).fetchone()
        if row is None:
            raise RuntimeError("key_read_1: no row")

    def control_read(self, c):
        row = c.execute(READ_SQL_1, (self.rng.choice(self.ids1),)).fetchone()
        if row is None:
            raise RuntimeError("control_read: no row")


OPS = [  # (key, label, what it sends)
    ("read", "autocommit read", READ_SQL),
    ("tx_read", "read in a transaction", f"BEGIN; {READ_SQL}; COMMIT"),
    ("tx_update", "update in a transaction", f"BEGIN; {UPDATE_SQL}; COMMIT"),
    ("tx_update_insert", "update then insert in a transaction (an audit row)",
     f"BEGIN; {UPDATE_SQL}; {INSERT_SQL}; COMMIT"),
    ("update", "autocommit update", UPDATE_SQL),
    ("orm_read", "ORM-style read (document + count of its versions)", f"{READ_SQL}; {COUNT_SQL}"),
    ("key_read", "read by primary key alone (the key map finds organization 2)", KEY_SQL),
    ("key_read_1", "read of organization 1's row by primary key alone", KEY_SQL),
    ("control_read", "control: autocommit read of organization 1 (cloud)", READ_SQL_1),
]
OP_LABEL = {k: lab for k, lab, _ in OPS}
OP_SHORT = {"read": "read", "tx_read": "read in tx", "tx_update": "update in tx",
            "tx_update_insert": "update+insert in tx", "update": "update",
            "orm_read": "ORM read", "key_read": "by key", "key_read_1": "org 1 by key",
            "control_read": "org 1 read (control)"}


# --------------------------------------------------------------------------------------
# /proc: CPU time of the proxy, relay and agent, in ticks and in ns (procs.sched_ns)


def cpu_reading(ctx) -> dict:
    return {"proxy_ticks": cpu_ticks(ctx.proxy.proc.pid), "proxy_ns": sched_ns(ctx.proxy.proc.pid),
            "relay_ticks": cpu_ticks(ctx.relay.pid), "relay_ns": sched_ns(ctx.relay.pid),
            "agent_ticks": cpu_ticks(ctx.agent.pid), "agent_ns": sched_ns(ctx.agent.pid)}


def cpu_per_op(a: dict, b: dict, n: int) -> dict:
    out = {}
    for who in ("proxy", "relay", "agent"):
        ticks = delta(a.get(f"{who}_ticks"), b.get(f"{who}_ticks"))
        ns = delta(a.get(f"{who}_ns"), b.get(f"{who}_ns"))
        out[f"{who}_ticks"] = ticks
        out[f"{who}_us_per_op_ticks"] = round(ticks_to_ms(ticks) * 1e3 / n, 1) if ticks is not None else None
        out[f"{who}_us_per_op"] = round(ns / 1e3 / n, 1) if ns is not None else None
    return out


# --------------------------------------------------------------------------------------
# One window: warm-up, N measured operations, one example operation


def window(ctx, conn, rtt: float, profile: str, op: str) -> dict:
    mode = ctx.mode
    fn = getattr(ctx.ops, op)
    rec = {"rtt_ms": rtt, "profile": profile, "op": op, "n": mode.n, "warmup": mode.warmup,
           "loadavg_before": loadavg(), "errors": []}
    settle = 0.1 + 2 * rtt / 1e3  # anything the proxy or postgres_fdw sends after the answer lands first
    between = ctx.log.cut()  # lines since the previous window (should be none)
    rec["between_windows"] = analyse(between, rtt, keep=20)
    for _ in range(mode.warmup):
        try:
            fn(conn)
        except Exception as e:  # noqa: BLE001
            rec["errors"].append(f"warm-up: {getattr(e, 'sqlstate', None) or type(e).__name__}: {str(e).strip()[:300]}")
    rec["warmup_log"] = analyse(ctx.log.cut(), rtt, keep=60)
    lat = []
    c0 = cpu_reading(ctx)
    t_win = t_cpu = time.perf_counter()
    for _ in range(mode.n):
        t = time.perf_counter()
        try:
            fn(conn)
        except Exception as e:  # noqa: BLE001
            rec["errors"].append(f"{getattr(e, 'sqlstate', None) or type(e).__name__}: {str(e).strip()[:300]}")
            continue
        lat.append((time.perf_counter() - t) * 1e3)
    rec["window_s"] = round(time.perf_counter() - t_win, 3)
    time.sleep(settle)
    c1 = cpu_reading(ctx)
    rec["cpu_window_s"] = round(time.perf_counter() - t_cpu, 3)
    measured = analyse(ctx.log.cut(), rtt, keep=150)
    rec["log"] = measured
    rec["cpu"] = cpu_per_op(c0, c1, mode.n)
    # One more operation on its own: its statements verbatim, the anatomy of one operation.
    try:
        fn(conn)
    except Exception as e:  # noqa: BLE001
        rec["errors"].append(f"example: {getattr(e, 'sqlstate', None) or type(e).__name__}: {str(e).strip()[:300]}")
    time.sleep(settle)
    rec["example"] = analyse(ctx.log.cut(), rtt, keep=60)
    lat.sort()
    rec["ok"] = len(lat)
    rec["latencies_ms"] = [round(x, 3) for x in lat]
    rec["p50_ms"] = round(percentile(lat, 0.5), 3) if lat else None
    rec["p95_ms"] = round(percentile(lat, 0.95), 3) if lat else None
    rec["mean_ms"] = round(sum(lat) / len(lat), 3) if lat else None
    # The brief's count: statement lines ÷ N ("statements"); postgres_fdw's Parse-only round trips
    # (named Parse lines of its sessions) on top; at RTT > 0 also round trips from the timestamps.
    rec["statements_per_op"] = round(measured["statements"] / mode.n, 2)
    rec["statements_by_source"] = {k: round(v / mode.n, 2) for k, v in measured["by_source"].items()}
    rec["fdw_parse_per_op"] = round(measured["by_parse"].get("fdw: named", 0) / mode.n, 2)
    rt = measured["round_trips_from_times"]
    rec["round_trips_per_op"] = round(rt / mode.n, 2) if rt is not None else None
    if rtt > 0 and lat:
        rec["p50_over_rtt"] = round(rec["p50_ms"] / rtt, 2)
    rec["loadavg_after"] = loadavg()
    log(f"    RTT {rtt:g} {profile:<10} {op:<12} {rec['statements_per_op']:5.2f} statements/op "
        f"(+{rec['fdw_parse_per_op']:g} fdw Parse; round trips {fmt(rec['round_trips_per_op'], 2)}) "
        f"{dict(measured['by_keyword'])}; p50 {fmt(rec['p50_ms'], 2)} ms p95 {fmt(rec['p95_ms'], 2)} ms; "
        f"proxy {fmt(rec['cpu']['proxy_us_per_op'])} µs/op" + (f"; {len(rec['errors'])} errors" if rec["errors"] else ""))
    return rec


def rtt_round(ctx, rtt: float, idx: int) -> dict:
    rec = {"rtt_ms": rtt, "windows": [], "errors": []}
    ctx.relay = ctx.link = ctx.agent = ctx.proxy = None
    conn = None
    try:
        start_tunnel(ctx, ORG, f"relay-rtt{rtt:g}", rtt)
        rec["relay_select1_ms"] = relay_rtt_ms(ctx)
        ctx.proxy = start_proxy(ctx, f"rtt{rtt:g}")
        rec["proxy_pid"] = ctx.proxy.proc.pid
        log(f"  RTT {rtt:g} ms: link up (SELECT 1 through relay + link {rec['relay_select1_ms']} ms), "
            f"proxy on port {ctx.proxy.port} (load average {loadavg()})")
        conn = client(ctx)
        conn.execute("SELECT 1")
        # The proxy's CPU while nothing happens (its per-operation CPU includes that share of a window).
        a = (sched_ns(ctx.proxy.proc.pid), sched_ns(ctx.relay.pid))
        time.sleep(2.0)
        b = (sched_ns(ctx.proxy.proc.pid), sched_ns(ctx.relay.pid))
        rec["idle_us_per_s"] = {"proxy": round((b[0] - a[0]) / 1e3 / 2.0, 1), "relay": round((b[1] - a[1]) / 1e3 / 2.0, 1)}
        # Alternate which profile goes first from one RTT to the next.
        order = PROFILES if idx % 2 == 0 else list(reversed(PROFILES))
        for profile in order:
            set_profile(ctx, profile)
            for op, _, _ in OPS:
                if conn.closed or conn.broken:
                    rec["errors"].append(f"{profile} {op}: client connection lost, reconnected")
                    conn = client(ctx)
                w = window(ctx, conn, rtt, profile, op)
                rec["windows"].append(w)
                ctx.errors += [f"RTT {rtt:g} {profile} {op}: {e}" for e in w["errors"]]
                if w["log"]["error_count"]:
                    ctx.errors.append(f"RTT {rtt:g} {profile} {op}: org database logged "
                                      f"{w['log']['error_count']} errors, e.g. {w['log']['errors'][0]}")
                if ctx.proxy.proc.poll() is not None:
                    raise RuntimeError(f"the proxy exited ({ctx.proxy.proc.returncode}):\n"
                                       + ctx.proxy.stderr_path.read_text(errors="replace")[-2000:])
        rec["proxy_rss_kib"] = rss_kib(ctx.proxy.proc.pid)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001
        rec["error"] = repr(e)
        rec["traceback"] = traceback.format_exc()
        ctx.errors.append(f"RTT {rtt:g}: {e!r}")
        log(f"  RTT {rtt:g} FAILED: {e!r}")
        traceback.print_exc()
    finally:
        if conn is not None:
            try:
                conn.close()
            except psycopg.Error:
                pass
        stop_tunnel(ctx, rec)
        try:
            rec["after_teardown"] = analyse(ctx.log.cut(), rtt, keep=20)
        except Exception as e:  # noqa: BLE001
            rec["after_teardown"] = {"error": repr(e)}
    return rec


# --------------------------------------------------------------------------------------
# Summary


def summarize(raw: dict) -> dict:
    rows = {}
    base = {}
    for r in raw.get("rounds", []):
        for w in r.get("windows", []):
            rows[(w["rtt_ms"], w["profile"], w["op"])] = w
            if w["rtt_ms"] == 0:
                base[(w["profile"], w["op"])] = w.get("p50_ms")
    rtts = sorted({k[0] for k in rows})
    measured = {k[2] for k in rows}
    out = []
    for op, _, _ in OPS:
        # An operation added to the script after the run has nothing to show for it.
        if op not in measured:
            continue
        for profile in PROFILES:
            cells = {}
            for rtt in rtts:
                w = rows.get((rtt, profile, op))
                if not w:
                    continue
                b = base.get((profile, op))
                ex = w["example"]
                cells[str(rtt)] = {
                    "statements": w["statements_per_op"], "by_source": w["statements_by_source"],
                    "fdw_parse": w["fdw_parse_per_op"], "round_trips": w["round_trips_per_op"],
                    "by_keyword": {k: round(v / w["n"], 2) for k, v in w["log"]["by_keyword"].items()},
                    "p50_ms": w["p50_ms"], "p95_ms": w["p95_ms"],
                    "p50_over_rtt": w.get("p50_over_rtt"),
                    "added_over_rtt": round((w["p50_ms"] - b) / rtt, 2)
                    if rtt > 0 and b is not None and w["p50_ms"] is not None else None,
                    "proxy_us_per_op": w["cpu"]["proxy_us_per_op"],
                    "proxy_us_per_op_ticks": w["cpu"]["proxy_us_per_op_ticks"],
                    "relay_us_per_op": w["cpu"]["relay_us_per_op"],
                    "ok": w["ok"], "n": w["n"], "errors": len(w["errors"]),
                    "example_groups": ex.get("groups") or [],
                    "example": [(("ᵈ" if x["source"] == "direct" else "") + x["kw"]) for x in ex["lines"]
                                if x["protocol"] != "parse" or (x["source"] == "fdw" and x.get("name") != "<unnamed>")],
                    "example_sql": [f"[{x['source']}, {x['protocol']}] {x['sql']}" for x in ex["lines"]],
                }
            out.append({"op": op, "profile": profile, "cells": cells})
    idle = {str(r["rtt_ms"]): r.get("idle_us_per_s") for r in raw.get("rounds", [])}
    for row in out:  # the proxy's CPU net of what it spends idle over the same time
        for r, c in row["cells"].items():
            w = rows[(float(r), row["profile"], row["op"])]
            i = (idle.get(r) or {}).get("proxy")
            c["proxy_us_per_op_net"] = round(c["proxy_us_per_op"] - i * w["cpu_window_s"] / w["n"], 1) \
                if i is not None and c["proxy_us_per_op"] is not None and w.get("cpu_window_s") else None
    return {"rtts": rtts, "rows": out, "idle_us_per_s": idle}


def anatomy(cell: dict) -> str:
    """One operation's requests to the org database: round trips in brackets (requests that arrived
    together joined by +; a Parse shown only when it was a round trip of its own)."""
    groups = cell.get("example_groups")
    if groups:
        parts = []
        for g in groups:
            keep = [x for x in g if not x.lstrip("ᵈ").startswith("Parse ")] or g
            parts.append("[" + " + ".join(keep) + "]")
        return f"{len(groups)} round trips: " + " ".join(parts)
    ex = cell.get("example") or []
    return f"{len(ex)}: " + " · ".join(ex) if ex else "(none)"


def ops_in(s) -> list[str]:
    """The operations the run measured, in OPS's order."""
    return [op for op, _, _ in OPS if any(x["op"] == op for x in s["rows"])]


def _row(s, op, profile):
    return next(x for x in s["rows"] if x["op"] == op and x["profile"] == profile)


def _op_rows(s, rtts, cell) -> list[str]:
    """A table row per operation and profile: cell(c, rtt) for its cell c at each RTT, "—" where it has none."""
    L = []
    for row in s["rows"]:
        cells = []
        for r in rtts:
            c = row["cells"].get(str(r))
            cells.append(cell(c, r) if c else "—")
        L.append(f"| {OP_SHORT[row['op']]} | {row['profile']} | " + " | ".join(cells) + " |")
    return L


def tables_md(s: dict) -> list[str]:
    rtts = s["rtts"]
    pos = [r for r in rtts if r > 0]
    L = ["## Round trips to organization 2's database per operation", ""]
    if pos:
        L += ["Round trips, from the timestamps of its log: requests that arrive together (a pipeline) are logged "
              "within a millisecond, the next request of an operation at least one RTT later, so the number of groups "
              "of log events more than RTT/2 apart, ÷ N. Not defined at RTT 0.", "",
              "| operation | profile | " + " | ".join(f"RTT {r:g} ms" for r in pos) + " |",
              "|---|---|" + "---:|" * len(pos)]
        L += _op_rows(s, pos, lambda c, r: f"**{fmt(c['round_trips'], 2)}**"
                                           + (f" ⚠ {c['errors']} errors" if c["errors"] else ""))
        L.append("")
    L += ["Statements in its log (`LOG:  statement:` / `LOG:  execute` lines of every session but the benchmark's "
          "own, between the markers around the N measured operations) ÷ N. `+1 Parse`: postgres_fdw's Parse of its "
          "prepared UPDATE (PQprepare), a round trip with no statement line (seen as a `duration: … parse` line). "
          "`direct`: how many came by the direct path (the client's own session in the org database).", "",
          "| operation | profile | " + " | ".join(f"RTT {r:g} ms" for r in rtts) + " |",
          "|---|---|" + "---:|" * len(rtts)]

    def statements(c, r):
        d = c["by_source"].get("direct")
        t = fmt(c["statements"], 2)
        if c["fdw_parse"]:
            t += f" +{c['fdw_parse']:g} Parse"
        if d:
            t += " (all direct)" if d == c["statements"] else f" ({fmt(d, 2)} direct)"
        return t
    L += _op_rows(s, rtts, statements)
    L.append("")
    big = max(rtts)
    L += [f"### One operation's requests to the org database (the example operation after the window, RTT {big:g} ms)",
          "", "ᵈ = by the direct path, else postgres_fdw's session from the cloud. Verbatim SQL: `raw.json.gz`, "
          "`rounds[].windows[].example.lines`.", "",
          "| operation | profile | requests |", "|---|---|---|"]
    for row in s["rows"]:
        c = row["cells"].get(str(big))
        if c:
            L.append(f"| {OP_SHORT[row['op']]} | {row['profile']} | {anatomy(c)} |")
    L.append("")
    L += ["## Latency (one client, warm connection)", "",
          "p50 / p95 in ms; for RTT > 0 also **p50 ÷ RTT** and (p50 − p50 at RTT 0) ÷ RTT.", "",
          "| operation | profile | " + " | ".join(f"RTT {r:g}: p50 / p95" + (" · ÷RTT · added÷RTT" if r > 0 else "")
                                             for r in rtts) + " |",
          "|---|---|" + "---|" * len(rtts)]

    def latency(c, r):
        t = f"{fmt(c['p50_ms'], 2)} / {fmt(c['p95_ms'], 2)}"
        if r > 0:
            t += f" · **{fmt(c['p50_over_rtt'], 2)}** · {fmt(c['added_over_rtt'], 2)}"
        return t
    L += _op_rows(s, rtts, latency)
    L.append("")
    L += ["### fdw+direct ÷ fdw (p50 latency, same run)", "",
          "| operation | " + " | ".join(f"RTT {r:g} ms" for r in rtts) + " |", "|---|" + "---:|" * len(rtts)]
    for op in ops_in(s):
        a, b = _row(s, op, "fdw"), _row(s, op, "fdw+direct")
        cells = []
        for r in rtts:
            ca, cb = a["cells"].get(str(r)), b["cells"].get(str(r))
            cells.append(fmt(cb["p50_ms"] / ca["p50_ms"], 2) if ca and cb and ca["p50_ms"] and cb["p50_ms"] else "—")
        L.append(f"| {OP_SHORT[op]} | " + " | ".join(cells) + " |")
    L.append("")
    L += ["## CPU time of the proxy per operation (µs)", "",
          "From the proxy's threads' `/proc/PID/task/*/schedstat` (ns) over the window ÷ N; in brackets the same "
          "from `/proc/PID/stat` utime+stime (10 ms clock ticks: coarse for windows this short); net = minus what the "
          "proxy spends idle over the same time (last row: µs of CPU per second with the client connected and idle, "
          "measured for 2 s before the windows of that RTT). Relay: schedstat, not net.", "",
          "| operation | profile | " + " | ".join(f"RTT {r:g}: proxy · net (ticks) · relay" for r in rtts) + " |",
          "|---|---|" + "---|" * len(rtts)]
    L += _op_rows(s, rtts, lambda c, r: f"{fmt(c['proxy_us_per_op'])} · {fmt(c.get('proxy_us_per_op_net'))} "
                                        f"({fmt(c['proxy_us_per_op_ticks'], 0)}) · {fmt(c['relay_us_per_op'])}")
    idle = s.get("idle_us_per_s") or {}
    L.append("| idle, µs per second | — | " + " | ".join(
        f"{fmt((idle.get(str(r)) or {}).get('proxy'))} · {fmt((idle.get(str(r)) or {}).get('relay'))}" for r in rtts) + " |")
    L.append("")
    return L


def checks_md(raw: dict, s: dict) -> list[str]:
    """Automatic observations: what the profiles are expected to do, and where they did not."""
    L = []
    for row in s["rows"]:
        for r, c in row["cells"].items():
            where = f"RTT {float(r):g} ms, {row['profile']}, {OP_SHORT[row['op']]}"
            if row["op"] in ("control_read", "key_read_1") and (c["statements"] or c["fdw_parse"]):
                L.append(f"- {where}: {c['statements']} statements per operation reached organization 2 (expected 0).")
            if row["profile"] == "fdw" and c["by_source"].get("direct"):
                L.append(f"- {where}: {c['by_source']['direct']} statements per operation came by the direct path on fdw.")
            if c["errors"]:
                L.append(f"- {where}: {c['errors']} failed operations.")
    for op in ops_in(s):
        # Organization 1's reads never reach organization 2; a read by key alone goes through
        # the cloud on both profiles (the proxy does not know its organization).
        if op in ("control_read", "key_read", "key_read_1"):
            continue
        a, b = _row(s, op, "fdw"), _row(s, op, "fdw+direct")
        for r in s["rtts"]:
            ca, cb = a["cells"].get(str(r)), b["cells"].get(str(r))
            if not (ca and cb):
                continue
            ka = ca["round_trips"] if ca["round_trips"] is not None else ca["statements"] + ca["fdw_parse"]
            kb = cb["round_trips"] if cb["round_trips"] is not None else cb["statements"] + cb["fdw_parse"]
            if kb >= ka:
                what = "round trips" if cb["round_trips"] is not None else "statements + Parse"
                L.append(f"- RTT {r:g} ms, {OP_SHORT[op]}: fdw+direct {fmt(kb, 2)} {what} per operation, fdw "
                         f"{fmt(ka, 2)} — no fewer on fdw+direct"
                         + (" (none of them by the direct path: it went through the cloud)"
                            if not cb["by_source"].get("direct") else "") + ".")
    for r in raw.get("rounds", []):
        for w in r.get("windows", []):
            if w["between_windows"]["statements"]:
                L.append(f"- RTT {w['rtt_ms']:g} ms, before {w['profile']} {w['op']}: "
                         f"{w['between_windows']['statements']} statements outside any window "
                         f"({w['between_windows']['by_keyword']}).")
            if w["log"]["error_count"]:
                L.append(f"- RTT {w['rtt_ms']:g} ms, {w['profile']} {w['op']}: the org database logged "
                         f"{w['log']['error_count']} errors, e.g. `{w['log']['errors'][0]}`.")
    return L


def summary_markdown(raw: dict, s: dict) -> str:
    m = raw["meta"]
    w = raw.get("world") or {}
    L = [f"# Routing benchmark, {m['mode']} mode — run {m['run_id']}", "",
         f"Commit `{m['git']['commit'][:12]}`{' (dirty tree)' if m['git']['dirty'] else ''}, "
         f"{m['machine']['nproc']} cores (shared), load average at start {m['machine']['loadavg_at_start']}, "
         f"{m.get('wall_seconds', 0):.0f} s in all. Binaries: `{bin_dir_of(m, BIN_DIR)}` (lokadb sha256 "
         f"`{m['binaries']['lokadb']['sha256'][:16]}…`, mtime {m['binaries']['lokadb']['mtime_utc']}). "
         f"Command: `{m['command'].strip()}`.", "",
         f"World: cloud and organization 2's PostgreSQL 18 clusters; organization 2 moved once with "
         f"`lokadb move-org 2 --profile fdw` ({fmt((w.get('org_rows') or {}).get('documents'))} documents, "
         f"{fmt((w.get('org_rows') or {}).get('document_versions'))} versions in its database), organization 1 "
         f"({fmt((w.get('ids') or {}).get(OTHER))} documents) in the cloud. Per RTT a fresh relay, latency link "
         f"(RTT/2 each way, agent ↔ relay), agent and `lokadb proxy` (direct path login configured, all else "
         f"default); one psycopg {m['machine'].get('psycopg')} client through the proxy, autocommit, "
         f"warm ({m['mode_settings']['warmup']} warm-up operations per window, more than psycopg's "
         f"prepare_threshold), N = {m['mode_settings']['n']} measured operations per window. Profiles switched "
         f"with `UPDATE lokadb.org SET profile = …` (+0.5 s).", ""]
    L.append("| RTT | `SELECT 1` through relay + link (p50 of 10) | proxy RSS at the end |")
    L.append("|---:|---:|---:|")
    for r in raw.get("rounds", []):
        L.append(f"| {r['rtt_ms']:g} ms | {fmt(r.get('relay_select1_ms'), 2)} ms | "
                 f"{fmt((r.get('proxy_rss_kib') or 0) / 1024, 1)} MiB |")
    L.append("")
    L.append("Operations (organization 2 unless said):\n")
    for k, lab, sql in OPS:
        if k in ops_in(s):
            L.append(f"- **{OP_SHORT[k]}** — {lab}: `{sql}`")
    L.append("")
    L += tables_md(s)
    obs = checks_md(raw, s)
    L.append("## Automatic checks\n")
    L += obs if obs else ["- nothing unexpected: control 0, no direct statements on fdw, no failed operations."]
    L.append("")
    if m["errors"]:
        L.append("## Errors\n")
        for e in m["errors"]:
            L.append(f"- {e[:1000]}")
        L.append("")
    L.append("Every window's statements (source, protocol, SQL, timestamp), latencies and CPU readings: `raw.json.gz`. "
             "Method: `research/bench/README.md`, \"Routing benchmark\".\n")
    return "\n".join(L)


COLORS = {"fdw": "#8b949e", "fdw+direct": "#1f6feb"}


def _bars(ax, s, key, rtt, x, ops, label_fmt="{:.1f}"):
    for j, profile in enumerate(PROFILES):
        vals = []
        for op in ops:
            c = _row(s, op, profile)["cells"].get(str(rtt))
            vals.append(c[key] if c else None)
        xs = [i + (j - 0.5) * 0.38 for i in x]
        ax.bar(xs, [v or 0 for v in vals], 0.38, label=profile, color=COLORS[profile])
        for xx, v in zip(xs, vals):
            if v is not None:
                ax.text(xx, v, label_fmt.format(v), ha="center", va="bottom", fontsize=7)


# Round trips to the organization's database per operation, the reference's (shared/seed/
# performance-reference.txt, "Where the round trips go on fdw" and "fdw+direct"; RESULTS.md's
# overview, row "Distance", and its section "Distance: round trips and RTT"): in a transaction a
# read ≈ 8 on fdw → ≈ 3 on fdw+direct, an update ≈ 8 → ≈ 2; autocommit on fdw a read ≈ 5, an
# update 8, the ORM read 10.
REFERENCE_ROUND_TRIPS = {("tx_read", "fdw"): 8, ("tx_read", "fdw+direct"): 3,
                         ("tx_update", "fdw"): 8, ("tx_update", "fdw+direct"): 2,
                         ("read", "fdw"): 5, ("update", "fdw"): 8, ("orm_read", "fdw"): 10}
# The goal (issue 6; RESULTS.md, same row and section): on fdw+direct a read and an update in a
# transaction in ≤ 2 round trips, an autocommit statement in 1.
GOAL_ROUND_TRIPS = {("tx_read", "fdw+direct"): 2, ("tx_update", "fdw+direct"): 2,
                    ("read", "fdw+direct"): 1, ("update", "fdw+direct"): 1}
# p50 ÷ RTT of the reference's operations in a transaction, at its 9.4 and 38.7 ms (the same
# file, "The price of distance"; RESULTS.md, "Distance"): read fdw 80.3 and 353 ms, fdw+direct
# 30.5 and 133; update fdw 80.5 and 353, fdw+direct 20.8 and 89.1. Drawn on our panel of the
# nearest RTT (10 and 40 ms).
REFERENCE_P50_MS = {9.4: {("tx_read", "fdw"): 80.3, ("tx_read", "fdw+direct"): 30.5,
                          ("tx_update", "fdw"): 80.5, ("tx_update", "fdw+direct"): 20.8},
                    38.7: {("tx_read", "fdw"): 353, ("tx_read", "fdw+direct"): 133,
                           ("tx_update", "fdw"): 353, ("tx_update", "fdw+direct"): 89.1}}


def _marks(ax, ops, figures: dict, label: str, style: dict) -> None:
    """figures[(op, profile)] over the bars of _bars, one legend entry."""
    for j, profile in enumerate(PROFILES):
        ys = [figures.get((op, profile)) for op in ops]
        marks(ax, [i + (j - 0.5) * 0.38 for i in range(len(ops))], ys, 0.38, label, style)
        if any(y is not None for y in ys):
            label = "_"


def draw_charts(outdir: Path, raw: dict, s: dict) -> list[str]:
    made = []
    pos = [r for r in s["rtts"] if r > 0]
    # Operations a run measured (an older run's raw numbers lack the ones added since).
    ops = [op for op, _, _ in OPS if any(_row(s, op, p)["cells"] for p in PROFILES)]
    x = list(range(len(ops)))
    names = [OP_SHORT[o].replace(" (control)", "\n(control)") for o in ops]
    if not pos:
        return made
    fig, axes = plt.subplots(1, len(pos), figsize=(6.2 * len(pos), 4.6), squeeze=False)
    for ax, rtt in zip(axes[0], pos):
        _bars(ax, s, "p50_over_rtt", rtt, x, ops)
        ref_rtt = min(REFERENCE_P50_MS, key=lambda r: abs(r - rtt))
        if abs(ref_rtt - rtt) <= 0.1 * rtt:
            _marks(ax, ops, {k: v / ref_rtt for k, v in REFERENCE_P50_MS[ref_rtt].items()},
                   f"reference: p50 ÷ RTT at its {ref_rtt:g} ms (in a transaction: read "
                   + ", ".join(f"{REFERENCE_P50_MS[ref_rtt][('tx_read', p)] / ref_rtt:.1f}" for p in PROFILES)
                   + "; update "
                   + ", ".join(f"{REFERENCE_P50_MS[ref_rtt][('tx_update', p)] / ref_rtt:.1f}" for p in PROFILES)
                   + ")", REFERENCE_STYLE)
        ax.set_xticks(x, names, fontsize=7)
        ax.set_ylabel("p50 latency ÷ RTT (≈ round trips)")
        ax.set_title(f"RTT {rtt:g} ms", fontsize=10)
        ax.margins(y=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Latency ÷ RTT per operation, fdw vs fdw+direct, one client, organization 2's database "
                 f"at the RTT ({raw['meta']['mode']} mode, run {raw['meta']['run_id']})", fontsize=10)
    fig.tight_layout()
    save_png(fig, outdir / "routing-latency-per-rtt.png", 110)
    plt.close(fig)
    made.append("routing-latency-per-rtt.png")
    big = max(pos)
    fig, ax = plt.subplots(figsize=(8, 4.4))
    _bars(ax, s, "round_trips", big, x, ops, "{:g}")
    _marks(ax, ops, REFERENCE_ROUND_TRIPS, "reference: fdw → fdw+direct, in a transaction read ≈ 8 → ≈ 3, "
           "update ≈ 8 → ≈ 2; fdw autocommit read ≈ 5, update 8, ORM read 10", REFERENCE_STYLE)
    _marks(ax, ops, GOAL_ROUND_TRIPS, "goal: fdw+direct ≤ 2 in a transaction, 1 autocommit", GOAL_STYLE)
    ax.set_xticks(x, names, fontsize=7)
    ax.set_ylabel("round trips to the organization per operation (count)")
    ax.set_title(f"Round trips to organization 2's database per operation\n(RTT {big:g} ms, from its log; "
                 f"{raw['meta']['mode']} mode, run {raw['meta']['run_id']})", fontsize=9)
    ax.margins(y=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, outdir / "routing-round-trips.png", 110)
    plt.close(fig)
    made.append("routing-round-trips.png")
    return made


def _grid(s, rtts, key, nd=2):
    L = ["| operation | " + " | ".join(f"{p}, RTT {r:g} ms" for r in rtts for p in PROFILES) + " |",
         "|---|" + "---:|" * (len(rtts) * len(PROFILES))]
    for op in ops_in(s):
        cells = []
        for r in rtts:
            for p in PROFILES:
                c = _row(s, op, p)["cells"].get(str(r))
                cells.append(fmt(c[key], nd) if c else "—")
        L.append(f"| {OP_SHORT[op]} | " + " | ".join(cells) + " |")
    return L


def update_charts_data(raw: dict, s: dict, outdir: Path, charts: list[str]) -> None:
    m = raw["meta"]
    mode = m["mode"]
    rel = f"results/{outdir.name}"
    rtts = s["rtts"]
    pos = [r for r in rtts if r > 0]
    body = ["## Routing: round trips to an organization" + (", quick mode — indicative only" if mode == "quick" else ""),
            "",
            f"Run `{outdir.name}` (folder `{rel}/`), commit `{m['git']['commit'][:12]}`"
            f"{' (dirty tree)' if m['git']['dirty'] else ''}, lokadb sha256 `{m['binaries']['lokadb']['sha256'][:12]}`, "
            f"{m['machine']['nproc']} cores, written by `research/bench/routing.py` (`{m['command'].strip()}`), "
            f"N = {m['mode_settings']['n']} operations per window, one client. Charts: "
            + ", ".join(f"`{rel}/{c}`" for c in charts) + ".", ""]
    if pos:
        body += ["### routing-latency-per-rtt.png — p50 latency ÷ RTT", ""] + _grid(s, pos, "p50_over_rtt") + [""]
        body += [f"### routing-round-trips.png — round trips to organization 2 per operation, from its log's "
                 f"timestamps (the chart: RTT {max(pos):g} ms)", ""] + _grid(s, pos, "round_trips") + [""]
    body += ["### statement lines in organization 2's log per operation (log_statement; without postgres_fdw's "
             "Parse of its prepared UPDATE)", ""] + _grid(s, rtts, "statements") + [""]
    body += ["### p50 latency (ms)", ""] + _grid(s, rtts, "p50_ms")
    write_charts_section(f"routing {mode}", "\n".join(body).rstrip("\n"))


def render(raw: dict, outdir: Path, charts_data: bool) -> str:
    s = summarize(raw)
    raw["summary"] = s
    if not s["rows"] or not s["rtts"]:
        return write_empty_summary(raw, outdir, "Routing benchmark", "window")
    return write_outputs(raw, s, outdir, charts_data, summary_markdown, draw_charts, update_charts_data)


# --------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="RTT 0 and 10 ms, 15 operations per window (≈ 35 s)")
    ap.add_argument("--out", type=Path, help="result folder (default results/<UTC ts>-routing[-quick]); "
                                             "a trial run: charts-data.md is left alone")
    ap.add_argument("--rtts", help="comma-separated RTTs in ms (default: quick 0,10, full 0,10,40)")
    ap.add_argument("--n", type=int, help="measured operations per window (default: quick 15, full 50)")
    ap.add_argument("--no-charts-data", action="store_true", help="leave charts-data.md alone")
    ap.add_argument("--render", type=Path, help="only rebuild summary.md, charts and charts-data.md from this raw.json or raw.json.gz")
    args = ap.parse_args()
    if args.render:
        return rerender(args.render, render, not args.no_charts_data)
    preflight("routing.py", (PG_BIN / "postgres", LOKADB_BIN, AGENT_BIN, LINK_BIN))
    mode = Mode(args.quick)
    if args.rtts:
        mode.rtts_ms = [float(x) for x in args.rtts.split(",")]
    if args.n:
        mode.n = args.n
    started, run_id, outdir = result_dir(args.out, "-routing", mode.quick)
    catch_signals()

    ctx = Ctx(mode)
    ctx.log = None
    meta = {"run_id": run_id, "mode": mode.name, "started_utc": started.isoformat(),
            "command": ("/work/main/.venv/bin/python research/bench/routing.py " + shlex.join(sys.argv[1:])).strip(),
            "env": {"LOKADB_BENCH_TARGET": os.environ.get("LOKADB_BENCH_TARGET")},
            "mode_settings": dict(vars(mode)), "machine": machine_info(), "git": git_info(),
            "binaries": {b.name: binary_info(b) for b in (LOKADB_BIN, AGENT_BIN, LINK_BIN)},
            "postgres_settings": {"cloud": CLOUD_PG, "org": {**ORG_PG, "log_line_prefix": ORG_LOG_PREFIX},
                                  "org_database": ORG_DB_SETTINGS, "fsync": "on (default)"},
            "operations": {k: {"label": lab, "sql": sql} for k, lab, sql in OPS},
            "client": {"driver": f"psycopg {psycopg.__version__}", "role": "postgres (SCRAM through the proxy)",
                       "autocommit": True, "application_name": CLIENT_APP, "prepare_threshold": 5},
            "setup_commands": ctx.commands, "errors": ctx.errors}
    raw = {"meta": meta, "world": None, "rounds": []}

    def body():
        rc = 0
        ctx.tmp = temp_dir("lokadb-routing-bench-")
        prepare_tunnel(ctx, ORG)
        log(f"mode={mode.name} RTTs={mode.rtts_ms} ms N={mode.n} binaries={BIN_DIR} out={outdir}")
        log("building the world (cloud + organization clusters, move-org)")
        raw["world"] = build_world(ctx)
        ctx.ops = Ops(ctx.ids2, ctx.ids1)
        ctx.log = OrgLog(ctx.org)
        meta["proxy_config"] = None
        for i, rtt in enumerate(mode.rtts_ms):
            r = rtt_round(ctx, float(rtt), i)
            meta["proxy_config"] = getattr(ctx, "proxy_config", None)
            raw["rounds"].append(r)
            (outdir / "raw.json").write_text(json.dumps(raw, indent=1, default=str))
            if r.get("error"):
                rc = 1
        return 1 if ctx.errors else rc

    def log_tails():
        for c in (getattr(ctx, "cloud", None), getattr(ctx, "org", None)):
            if c is not None:
                raw.setdefault("log_tails", {})[c.name] = c.log_tail()

    def close_log():
        if ctx.log is not None:
            ctx.log.close()

    return guarded_run(ctx, raw, outdir, render, not args.no_charts_data and not args.out, body,
                       binaries=(LOKADB_BIN, AGENT_BIN, LINK_BIN),
                       before_cleanup=close_log, on_error=log_tails)


if __name__ == "__main__":
    sys.exit(main())
