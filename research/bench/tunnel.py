#!/usr/bin/env python3
"""LokaDB tunnel benchmark: relay + agent, side by side with the direct path.

    /work/main/.venv/bin/python research/bench/tunnel.py [--quick] [--out DIR]

Scenarios (research/bench/README.md, "Tunnel benchmark"):

  throughput  one stream's COPY throughput through the latency link at 10 and 40 ms RTT for
              windows of 256 KiB .. 16 MiB, against window / RTT (plus the auto-tuned window
              when the binaries have it)
  streams     the relay's peak memory (VmHWM) with 2048 streams reading, then stalled
  latency     p50/p99 added by relay + tunnel + agent: postgres_fdw point reads from a cloud
              database (fdw server straight at the org vs at the relay), and a client straight
              at the org vs through the relay's Postgres listener
  agents      relay RSS with 0, 10, 100, 1000 idle agents (one organization each), and the time
              until every agent is back after a relay restart (SIGTERM, new relay, same ports)

Writes raw.json, summary.md and PNG charts into research/bench/results/<UTC ts>-tunnel[-quick]/
and the numbers behind the charts into research/bench/charts-data.md (tunnel sections).
Benchmarks whatever binaries are in $LOKADB_BENCH_TARGET (default /work/target-bench/release,
built with `CARGO_TARGET_DIR=/work/target-bench cargo build --release -p lokadb -p lokadb-agent
-p lokadb-tests`); it builds nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import socket
import statistics
import struct
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lib.binaries import AGENT_BIN, BIN_DIR, LINK_BIN, LOKADB_BIN, PG_BIN, REPO, bin_dir_of, binary_info  # noqa: E402
from lib.charts import GOAL_STYLE, REFERENCE_STYLE, goal_line, save_png  # noqa: E402
from lib.pgbench import parse_pgbench, read_txn_logs  # noqa: E402
from lib.clusters import PgCluster  # noqa: E402
from lib.procs import (  # noqa: E402
    catch_signals, cleanup, cpu_ticks, free_port, log, preflight, proc_status, raise_fd_limit, rss_kib,
    temp_dir, ticks_to_ms,
)
from lib.relay import Relay, make_certs, new_token, start_agent, start_link, stop_agents  # noqa: E402
from lib.results import (  # noqa: E402
    Ctx, git_info, machine_info, read_raw, result_dir, write_charts_section, write_outputs, write_raw_gz,
)

import matplotlib.pyplot as plt  # noqa: E402  (lib set the Agg backend)

APP_PASSWORD = "app-bench-secret"
ORG = "acme"
ORG_DB = "orgdb"
ITEMS = 10_000
ROW = 8000  # bytes of each COPY row's payload
COPY_SQL = f"COPY (SELECT generate_series(1, 1000000000), repeat('x', {ROW})) TO STDOUT"
GUARD_RSS_KIB = 4 << 20  # the 2048-stream phases end early past 4 GiB of relay RSS
GUARD_AVAILABLE_KIB = 3 << 20  # ... or under 3 GiB of MemAvailable (a shared box)


class Mode:
    def __init__(self, quick: bool):
        self.quick = quick
        self.name = "quick" if quick else "full"
        self.reps = 1 if quick else 2  # throughput points
        self.t_copy = 2.0 if quick else 5.0  # seconds of reading per throughput point (> 1: "after 1st s")
        self.rtts_ms = [10, 40]
        self.windows_kib = [256, 1024, 4096, 16384]
        self.lat_reps = 2 if quick else 3
        self.t_lat = 1 if quick else 6
        self.streams = 2048
        # 1 MiB, not the default 4 MiB: the agent holds about one window per stream it reads
        # from Postgres (7 GB at ~1650 streams in a 4 MiB trial), too much for this shared box.
        self.streams_window_kib = 1024
        self.t_streams_read = 2 if quick else 10
        self.t_streams_stall = 2 if quick else 8
        self.agent_levels = [10, 100, 1000]
        self.restart_levels = [10, 100] if quick else [10, 100, 1000]
        self.restart_reps = 2 if quick else 3


# --------------------------------------------------------------------------------------
# /proc


def loadavg():
    return float(Path("/proc/loadavg").read_text().split()[0])


def med(v):
    v = [x for x in v if x is not None]
    return statistics.median(v) if v else None


# --------------------------------------------------------------------------------------
# The world


class Cluster(PgCluster):
    """A throwaway cluster run as lokadb-pg (lib.clusters.PgCluster), started at once, whose role
    raw logs in without a password over TCP: the raw-protocol benchmark clients."""

    def __init__(self, root: Path, name: str, settings: dict, commands: list):
        super().__init__(root, name, commands)
        self.initdb()
        hba = self.data / "pg_hba.conf"
        hba.write_text("host all raw 127.0.0.1/32 trust\n" + hba.read_text())
        self.start(settings)

    def backends(self, dbname: str) -> int:
        with self.conn() as c:
            return c.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s",
                             (dbname,)).fetchone()[0]


# --------------------------------------------------------------------------------------
# A minimal Postgres protocol client (trust auth as role raw): no parsing of the data.


def startup_packet(user: str, database: str) -> bytes:
    body = struct.pack("!I", 196608) + f"user\0{user}\0database\0{database}\0\0".encode()
    return struct.pack("!I", len(body) + 4) + body


def query_packet(sql: str) -> bytes:
    b = sql.encode() + b"\0"
    return b"Q" + struct.pack("!I", len(b) + 4) + b


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise RuntimeError("connection closed")
        buf += chunk
    return bytes(buf)


def raw_connect(port: int, database: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(startup_packet("raw", database))
    while True:
        tag, ln = struct.unpack("!cI", recv_exact(s, 5))
        body = recv_exact(s, ln - 4)
        if tag == b"E":
            raise RuntimeError(f"server error: {body!r}")
        if tag == b"R" and struct.unpack("!I", body[:4])[0] != 0:
            raise RuntimeError("raw role wants a password")
        if tag == b"Z":
            return s


def copy_read(port: int, database: str, seconds: float) -> dict:
    """Starts the endless COPY and reads it for `seconds` after the first byte; closes."""
    s = raw_connect(port, database)
    buf = bytearray(1 << 20)
    t_query = time.monotonic()
    s.sendall(query_packet(COPY_SQL))
    n = s.recv_into(buf)
    if n == 0 or buf[0:1] != b"H":
        raise RuntimeError(f"no CopyOutResponse: {bytes(buf[:200])!r}")
    t0 = time.monotonic()
    total = n
    at1 = None
    end = t0 + seconds
    while True:
        n = s.recv_into(buf)
        if n == 0:
            raise RuntimeError("COPY ended early")
        total += n
        now = time.monotonic()
        if at1 is None and now >= t0 + 1.0:
            at1 = (now, total)
        if now >= end:
            break
    s.close()
    out = {"bytes": total, "seconds": now - t0, "first_byte_ms": (t0 - t_query) * 1000,
           "mb_s": total / (now - t0) / 1e6}
    if at1 and now > at1[0]:
        out["mb_s_after_1s"] = (total - at1[1]) / (now - at1[0]) / 1e6
    return out


# --------------------------------------------------------------------------------------
# Scenario 1: one stream's throughput


def auto_available() -> dict:
    src = subprocess.run(["grep", "-rlE", "LOKADB_MUX_AUTO|auto_from_env", str(REPO / "proxy"), str(REPO / "agent")],
                         capture_output=True, text=True).stdout.split()
    src = [s for s in src if s.endswith(".rs")]

    def in_bin(p):
        try:
            return b"LOKADB_MUX_AUTO" in p.read_bytes()
        except OSError:
            return False

    return {"source_files": src, "relay_binary": in_bin(LOKADB_BIN), "agent_binary": in_bin(AGENT_BIN)}


def scenario_throughput(ctx) -> dict:
    mode, tmp, commands = ctx.mode, ctx.tmp, ctx.commands
    org = ctx.org
    token, thash = new_token(ORG)
    logf = open(tmp / "agents.stderr.log", "ab")
    res = {"points": [], "references": [], "auto": auto_available()}

    def tunnel_point(label, rtt_ms, env, window_kib, expected, force_link=False):
        relay = Relay(tmp, ctx.certs, {ORG: thash}, env, commands, tag="relay-tp")
        link = None
        try:
            port = relay.agents_port
            if rtt_ms or force_link:
                link = start_link(relay.agents_port, rtt_ms / 2, tmp, commands)
                port = link.port
            agent = start_agent(f"127.0.0.1:{port}", token, org.addr(), ctx.certs["ca"], env, logf)
            relay.wait_connected(1, timeout=30)
            for rep in range(mode.reps):
                st0 = relay.stats()
                r0, a0 = cpu_ticks(relay.pid), cpu_ticks(agent.pid)
                l0 = cpu_ticks(link.proc.pid) if link else 0
                la = loadavg()
                try:
                    r = copy_read(relay.pg_port, f"{ORG}/{ORG_DB}", mode.t_copy)
                except Exception as e:  # noqa: BLE001
                    r = {"error": str(e)}
                    ctx.errors.append(f"throughput {label} rep {rep}: {e}")
                r1, a1 = cpu_ticks(relay.pid), cpu_ticks(agent.pid)
                l1 = cpu_ticks(link.proc.pid) if link else 0
                time.sleep(0.3)  # let the reset reach the agent before the next point
                st1 = relay.stats()
                r.update({"label": label, "rtt_ms": rtt_ms, "window_kib": window_kib, "env": env,
                          "rep": rep, "expected_mb_s": expected, "loadavg_before": la,
                          "relay_cpu_ms": ticks_to_ms(r1 - r0), "agent_cpu_ms": ticks_to_ms(a1 - a0),
                          "link_cpu_ms": ticks_to_ms(l1 - l0),
                          "window_stalls": st1.get("window_stalls", 0) - st0.get("window_stalls", 0)})
                if "bytes" in r:
                    gb = r["bytes"] / 1e9
                    r["relay_cpu_ms_per_gb"] = r["relay_cpu_ms"] / gb
                    r["agent_cpu_ms_per_gb"] = r["agent_cpu_ms"] / gb
                    r["link_cpu_ms_per_gb"] = r["link_cpu_ms"] / gb
                    if expected:
                        r["ratio_to_expected"] = r["mb_s"] / expected
                log(f"  {label} rep {rep}: {r.get('mb_s', 0):.1f} MB/s"
                    + (f" (window/RTT {expected:.1f}, ratio {r.get('ratio_to_expected', 0):.2f})" if expected else "")
                    + f", relay {r['relay_cpu_ms']:.0f} ms CPU, agent {r['agent_cpu_ms']:.0f} ms")
                res["points"].append(r)
            stop_agents([agent])
        finally:
            if link:
                link.stop()
            relay.stop()

    # References: the org directly, and the tunnel without the link (default 4 MiB window).
    for rep in range(mode.reps):
        r = copy_read(org.port, ORG_DB, mode.t_copy)
        r.update({"label": "direct to Postgres", "rep": rep})
        log(f"  direct to Postgres rep {rep}: {r['mb_s']:.1f} MB/s")
        res["references"].append(r)
    tunnel_point("tunnel, no link (0 ms), 4 MiB", 0, {}, 4096, None)
    # The link's own cost: through it with no delay and a window no RTT here limits.
    tunnel_point("tunnel, link with 0 ms delay, 16 MiB", 0.0, {"LOKADB_MUX_WINDOW_KB": "16384"}, 16384, None,
                 force_link=True)
    for rtt in mode.rtts_ms:
        for w in mode.windows_kib:
            expected = w * 1024 / (rtt / 1000) / 1e6
            tunnel_point(f"{rtt} ms, {w} KiB", rtt, {"LOKADB_MUX_WINDOW_KB": str(w)}, w, expected)
        if res["auto"]["relay_binary"] and res["auto"]["agent_binary"]:
            env = {"LOKADB_MUX_WINDOW_KB": "256", "LOKADB_MUX_AUTO": "1", "LOKADB_MUX_MAX_WINDOW_KB": "16384"}
            tunnel_point(f"{rtt} ms, auto 256 KiB → ≤16 MiB", rtt, env, "auto 256 KiB", None)
            env = {"LOKADB_MUX_AUTO": "1", "LOKADB_MUX_MAX_WINDOW_KB": "16384"}
            tunnel_point(f"{rtt} ms, auto 4 MiB (default) → ≤16 MiB", rtt, env, "auto 4 MiB", None)
    return res


# --------------------------------------------------------------------------------------
# Scenario 2: 2048 streams


async def _stream_client(port, db, st, idx, opened, go, gate):
    """Logs in (trust, role raw), waits for `go`, starts the endless COPY, reads it."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(startup_packet("raw", db))
        while True:
            hdr = await reader.readexactly(5)
            tag, ln = struct.unpack("!cI", hdr)
            body = await reader.readexactly(ln - 4)
            if tag == b"E":
                raise RuntimeError(body[:200])
            if tag == b"Z":
                break
        st["open"][idx] = True
        opened.release()
        await go.wait()
        writer.write(query_packet(COPY_SQL))
        while not st["stop"]:
            if st["stall"]:
                await gate.wait()
                continue
            data = await reader.read(1 << 16)
            if not data:
                raise RuntimeError("EOF")
            st["bytes"][idx] += len(data)
        writer.close()
    except Exception as e:  # noqa: BLE001
        st["errors"][idx] = repr(e)[:200]
        if not st["open"][idx]:
            opened.release()


def mem_available_kib():
    return int(re.search(r"MemAvailable:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))


def guard_hit(relay_pid) -> str | None:
    if (proc_status(relay_pid).get("VmRSS") or 0) > GUARD_RSS_KIB:
        return f"relay RSS over {GUARD_RSS_KIB // 1024} MiB"
    if mem_available_kib() < GUARD_AVAILABLE_KIB:
        return f"MemAvailable under {GUARD_AVAILABLE_KIB // 1024} MiB"
    return None


async def _streams_main(relay: Relay, agent_pid: int, n: int, mode: Mode, out: dict):
    st = {"bytes": [0] * n, "errors": [None] * n, "open": [False] * n, "stop": False, "stall": False}
    opened = asyncio.Semaphore(64)
    go = asyncio.Event()
    gate = asyncio.Event()
    gate.set()
    db = f"{ORG}/{ORG_DB}"
    samples = []

    def sample(phase):
        s = proc_status(relay.pid)
        a = proc_status(agent_pid)
        samples.append({"t": round(time.monotonic() - t_start, 2), "phase": phase,
                        "rss_kib": s.get("VmRSS"), "hwm_kib": s.get("VmHWM"),
                        "agent_rss_kib": a.get("VmRSS"), "mem_available_kib": mem_available_kib(),
                        "bytes": sum(st["bytes"])})
        return s

    t_start = time.monotonic()
    out["before"] = proc_status(relay.pid)
    tasks = []
    for i in range(n):  # at most 64 logins in flight
        await opened.acquire()
        tasks.append(asyncio.create_task(_stream_client(relay.pg_port, db, st, i, opened, go, gate)))
        if i % 128 == 127:
            sample("opening")
    while sum(st["open"]) + sum(1 for e in st["errors"] if e) < n:
        await asyncio.sleep(0.05)
    out["open_seconds"] = round(time.monotonic() - t_start, 2)
    out["open_errors"] = sum(1 for e in st["errors"] if e)
    out["streams_open_stat"] = relay.stats().get("streams_open")
    out["idle_open"] = proc_status(relay.pid)
    log(f"  {n} streams logged in in {out['open_seconds']} s ({out['open_errors']} errors), relay "
        f"RSS {out['idle_open'].get('VmRSS')} KiB; starting the COPYs")
    c0, ca0, st0 = cpu_ticks(relay.pid), cpu_ticks(agent_pid), relay.stats()
    go.set()
    # Reading: every stream drains as fast as this one Python thread can.
    b0, t0 = sum(st["bytes"]), time.monotonic()
    guard = None
    while time.monotonic() - t0 < mode.t_streams_read and not guard:
        await asyncio.sleep(0.25)
        sample("reading")
        guard = guard_hit(relay.pid)
    b1, t1 = sum(st["bytes"]), time.monotonic()
    s, a = proc_status(relay.pid), proc_status(agent_pid)
    out["reading"] = {"seconds": round(t1 - t0, 2), "mb_s": (b1 - b0) / (t1 - t0) / 1e6,
                      "rss_kib": s.get("VmRSS"), "hwm_kib": s.get("VmHWM"), "guard": guard,
                      "agent_rss_kib": a.get("VmRSS"), "agent_hwm_kib": a.get("VmHWM"),
                      "streams_reading": sum(1 for i in range(n) if st["errors"][i] is None),
                      "streams_that_got_data": sum(1 for b in st["bytes"] if b > 0),
                      "relay_cpu_ms": ticks_to_ms(cpu_ticks(relay.pid) - c0),
                      "agent_cpu_ms": ticks_to_ms(cpu_ticks(agent_pid) - ca0),
                      "relay_bytes_from_agents": relay.stats().get("bytes_from_agents", 0) - st0.get("bytes_from_agents", 0)}
    out["reading"]["relay_cpu_ms_per_gb"] = out["reading"]["relay_cpu_ms"] / max(1e-9, (b1 - b0) / 1e9)
    log(f"  reading: {out['reading']['mb_s']:.1f} MB/s over all streams, relay RSS "
        f"{s.get('VmRSS')} KiB, VmHWM {s.get('VmHWM')} KiB, agent RSS {a.get('VmRSS')} KiB"
        + (f" (guard: {guard})" if guard else ""))
    # Stalled: nobody reads; the relay may hold up to one window per stream.
    if not guard:
        st["stall"] = True
        gate.clear()
        t0 = time.monotonic()
        while time.monotonic() - t0 < mode.t_streams_stall and not guard:
            await asyncio.sleep(0.25)
            sample("stalled")
            guard = guard_hit(relay.pid)
        s, a = proc_status(relay.pid), proc_status(agent_pid)
        out["stalled"] = {"seconds": round(time.monotonic() - t0, 2), "rss_kib": s.get("VmRSS"),
                          "hwm_kib": s.get("VmHWM"), "guard": guard,
                          "agent_rss_kib": a.get("VmRSS"), "agent_hwm_kib": a.get("VmHWM"),
                          "stats": relay.stats()}
        log(f"  stalled: relay RSS {s.get('VmRSS')} KiB, VmHWM {s.get('VmHWM')} KiB, agent RSS "
            f"{a.get('VmRSS')} KiB" + (f" (guard: {guard})" if guard else ""))
        st["stall"] = False
        gate.set()
        b0, t0 = sum(st["bytes"]), time.monotonic()
        while time.monotonic() - t0 < 3:
            await asyncio.sleep(0.25)
            sample("resumed")
        out["resumed"] = {"mb_s": (sum(st["bytes"]) - b0) / (time.monotonic() - t0) / 1e6,
                          "streams_alive": sum(1 for i in range(n) if st["errors"][i] is None)}
    st["stop"] = True
    gate.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    errs = [e for e in st["errors"] if e]
    out["errors_total"] = len(errs)
    out["error_examples"] = sorted(set(errs))[:5]
    out["samples"] = samples


def scenario_streams(ctx) -> dict:
    mode, tmp = ctx.mode, ctx.tmp
    token, thash = new_token(ORG)
    logf = open(tmp / "agents.stderr.log", "ab")
    env = {"LOKADB_MUX_WINDOW_KB": str(mode.streams_window_kib)}
    relay = Relay(tmp, ctx.certs, {ORG: thash}, env, ctx.commands, extra_cfg={"max_streams": mode.streams + 52},
                  tag="relay-streams")
    agent = start_agent(f"127.0.0.1:{relay.agents_port}", token, ctx.org.addr(), ctx.certs["ca"], env, logf,
                        max_conns=mode.streams + 52)
    out = {"streams": mode.streams, "window_kib": mode.streams_window_kib, "relay_max_streams": mode.streams + 52,
           "agent_max_conns": mode.streams + 52}
    try:
        relay.wait_connected(1)
        asyncio.run(_streams_main(relay, agent.pid, mode.streams, mode, out))
        out["agent_status_end"] = proc_status(agent.pid)
        time.sleep(2)
        out["after_close"] = proc_status(relay.pid)
        out["org_backends_after"] = ctx.org.backends(ORG_DB)
    finally:
        stop_agents([agent])
        relay.stop()
    return out


# --------------------------------------------------------------------------------------
# Scenario 3: added latency


def scenario_latency(ctx) -> dict:
    mode, tmp = ctx.mode, ctx.tmp
    token, thash = new_token(ORG)
    logf = open(tmp / "agents.stderr.log", "ab")
    relay = Relay(tmp, ctx.certs, {ORG: thash}, {}, ctx.commands, tag="relay-lat")
    agent = start_agent(f"127.0.0.1:{relay.agents_port}", token, ctx.org.addr(), ctx.certs["ca"], {}, logf)
    relay.wait_connected(1)
    cloud = ctx.cloud
    with cloud.conn("app") as c:
        for name, port, db in (("direct", ctx.org.port, ORG_DB), ("tunnel", relay.pg_port, f"{ORG}/{ORG_DB}")):
            c.execute(f"DROP SERVER IF EXISTS org_{name} CASCADE")
            c.execute(f"CREATE SERVER org_{name} FOREIGN DATA WRAPPER postgres_fdw OPTIONS "
                      f"(host '127.0.0.1', port '{port}', dbname '{db}')")
            c.execute(f"CREATE USER MAPPING FOR app SERVER org_{name} OPTIONS (user 'app', password '{APP_PASSWORD}')")
            c.execute(f"CREATE FOREIGN TABLE items_{name} (id int, body text) SERVER org_{name} "
                      "OPTIONS (table_name 'items')")
            c.execute(f"ALTER FOREIGN TABLE items_{name} OWNER TO app")
    scripts = {}
    for name in ("direct", "tunnel"):
        p = tmp / f"fdw_{name}.sql"
        p.write_text(f"\\set id random(1, {ITEMS})\nSELECT id, body FROM items_{name} WHERE id = :id;\n")
        scripts[f"fdw {name}"] = (p, cloud.port, "app")
    p = tmp / "point.sql"
    p.write_text(f"\\set id random(1, {ITEMS})\nSELECT id, body FROM items WHERE id = :id;\n")
    scripts["client direct"] = (p, ctx.org.port, ORG_DB)
    scripts["client tunnel"] = (p, relay.pg_port, f"{ORG}/{ORG_DB}")
    pairs = [("fdw direct", "fdw tunnel"), ("client direct", "client tunnel")]
    runs = []
    try:
        for rep in range(mode.lat_reps):
            for pair in pairs:
                order = pair if rep % 2 == 0 else pair[::-1]
                for target in order:
                    script, port, db = scripts[target]
                    prefix = tmp / f"lat-{target.replace(' ', '_')}-{rep}"
                    cmd = [str(PG_BIN / "pgbench"), "-n", "-h", "127.0.0.1", "-p", str(port), "-U", "app",
                           "-c", "1", "-j", "1", "-T", str(mode.t_lat), "-M", "simple", "-f", str(script),
                           "-l", f"--log-prefix={prefix}", db]
                    env = dict(os.environ, PGPASSWORD=APP_PASSWORD, PGSSLMODE="disable")
                    st0 = relay.stats()
                    r0, a0 = cpu_ticks(relay.pid), cpu_ticks(agent.pid)
                    la = loadavg()
                    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp,
                                       timeout=mode.t_lat + 60)
                    r1, a1 = cpu_ticks(relay.pid), cpu_ticks(agent.pid)
                    st1 = relay.stats()
                    row = {"target": target,
                           "relay_stats_delta": {k: st1[k] - st0.get(k, 0) for k in st1
                                                 if k in ("streams_opened", "bytes_to_agents", "bytes_from_agents")}, "rep": rep, "cmd": shlex.join(cmd), "rc": p.returncode,
                           "loadavg_before": la, **parse_pgbench(p.stdout), **read_txn_logs(prefix),
                           "relay_cpu_ms": ticks_to_ms(r1 - r0), "agent_cpu_ms": ticks_to_ms(a1 - a0)}
                    if p.returncode != 0:
                        row["stderr_tail"] = p.stderr[-1500:]
                        ctx.errors.append(f"latency {target} rep {rep}: pgbench rc {p.returncode}: {p.stderr[-300:]}")
                    n = row.get("transactions") or 0
                    if n:
                        row["relay_cpu_us_per_txn"] = row["relay_cpu_ms"] * 1000 / n
                        row["agent_cpu_us_per_txn"] = row["agent_cpu_ms"] * 1000 / n
                    log(f"  {target} rep {rep}: p50 {row.get('p50_ms')} ms p99 {row.get('p99_ms')} ms, "
                        f"{row.get('tps')} tps, relay {row.get('relay_cpu_us_per_txn', 0):.1f} µs/txn, "
                        f"agent {row.get('agent_cpu_us_per_txn', 0):.1f} µs/txn")
                    runs.append(row)
                    for f in tmp.glob(prefix.name + ".*"):
                        f.unlink()
    finally:
        stop_agents([agent])
        relay.stop()
    out = {"runs": runs, "summary": {}}
    for pair in pairs:
        d, t = pair
        p50d = [r["p50_ms"] for r in runs if r["target"] == d and r.get("p50_ms") is not None]
        p50t = [r["p50_ms"] for r in runs if r["target"] == t and r.get("p50_ms") is not None]
        added = [r2["p50_ms"] - r1["p50_ms"] for r1 in runs for r2 in runs
                 if r1["target"] == d and r2["target"] == t and r1["rep"] == r2["rep"]
                 and r1.get("p50_ms") is not None and r2.get("p50_ms") is not None]
        added99 = [r2["p99_ms"] - r1["p99_ms"] for r1 in runs for r2 in runs
                   if r1["target"] == d and r2["target"] == t and r1["rep"] == r2["rep"]
                   and r1.get("p99_ms") is not None and r2.get("p99_ms") is not None]
        out["summary"][t] = {
            "p50_direct_ms": med(p50d), "p50_tunnel_ms": med(p50t),
            "p99_direct_ms": med([r["p99_ms"] for r in runs if r["target"] == d]),
            "p99_tunnel_ms": med([r["p99_ms"] for r in runs if r["target"] == t]),
            "added_p50_ms": med(added), "added_p50_per_rep_ms": added,
            "added_p99_ms": med(added99),
            "relay_cpu_us_per_txn": med([r.get("relay_cpu_us_per_txn") for r in runs if r["target"] == t]),
            "agent_cpu_us_per_txn": med([r.get("agent_cpu_us_per_txn") for r in runs if r["target"] == t]),
            "tps_direct": med([r.get("tps") for r in runs if r["target"] == d]),
            "tps_tunnel": med([r.get("tps") for r in runs if r["target"] == t]),
        }
    return out


# --------------------------------------------------------------------------------------
# Scenarios 4 and 5: idle agents and relay restarts


def scenario_agents(ctx) -> dict:
    mode, tmp = ctx.mode, ctx.tmp
    nmax = max(mode.agent_levels)
    orgs = [f"org{i:04d}" for i in range(1, nmax + 1)]
    toks = {o: new_token(o) for o in orgs}
    tokens = {o: h for o, (_, h) in toks.items()}
    a_port, p_port = free_port(), free_port()
    logf = open(tmp / "agents-idle.stderr.log", "ab")
    out = {"levels": [], "restarts": [], "tokens_in_config": nmax}
    relay = Relay(tmp, ctx.certs, tokens, {}, ctx.commands, a_port, p_port, tag="relay-agents")
    agents = []
    try:
        time.sleep(1.0)
        rss0 = [proc_status(relay.pid).get("VmRSS") for _ in range(3) if not time.sleep(0.2)]
        out["rss0_kib"] = med(rss0)
        out["rss0_status"] = proc_status(relay.pid)
        log(f"  relay with {nmax} tokens, no agent: RSS {out['rss0_kib']} KiB")
        for level in mode.agent_levels:
            t0 = time.monotonic()
            c0 = cpu_ticks(relay.pid)
            while len(agents) < level:
                o = orgs[len(agents)]
                agents.append(start_agent(f"127.0.0.1:{a_port}", toks[o][0], ctx.org.addr(),
                                          ctx.certs["ca"], {}, logf))
            t_spawned = time.monotonic()
            relay.wait_connected(level, timeout=120, poll=0.1)
            t_conn = time.monotonic()
            time.sleep(2.0)  # settle (agents' first keepalives)
            rss = med([proc_status(relay.pid).get("VmRSS") for _ in range(3) if not time.sleep(0.2)])
            st = proc_status(relay.pid)
            ag_rss = [rss_kib(p.pid) for p in agents[:20]]
            row = {"agents": level, "rss_kib": rss, "status": st,
                   "per_agent_kib": (rss - out["rss0_kib"]) / level,
                   "spawn_seconds": round(t_spawned - t0, 2), "connect_seconds": round(t_conn - t0, 2),
                   "relay_cpu_ms_connecting": ticks_to_ms(cpu_ticks(relay.pid) - c0),
                   "agent_rss_kib_median_of_20": med(ag_rss),
                   "loadavg": loadavg(), "mem_available_kib": int(re.search(
                       r"MemAvailable:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))}
            out["levels"].append(row)
            log(f"  {level} idle agents: relay RSS {rss} KiB → {row['per_agent_kib']:.1f} KiB per agent "
                f"(connected in {row['connect_seconds']} s; an agent's RSS ≈ {row['agent_rss_kib_median_of_20']} KiB)")
            if level in mode.restart_levels:
                for rep in range(mode.restart_reps):
                    t_term = time.monotonic()
                    relay.stop()
                    t_exit = time.monotonic()
                    relay = Relay(tmp, ctx.certs, tokens, {}, ctx.commands, a_port, p_port, tag="relay-agents")
                    t_back = relay.wait_connected(level, timeout=60, poll=0.005)
                    r = {"agents": level, "rep": rep, "old_exit_ms": (t_exit - t_term) * 1000,
                         "listening_to_all_back_ms": (t_back - relay.t_listening) * 1000,
                         "sigterm_to_all_back_ms": (t_back - t_term) * 1000, "loadavg": loadavg()}
                    time.sleep(1.5)
                    r["rss_after_reconnect_kib"] = proc_status(relay.pid).get("VmRSS")
                    out["restarts"].append(r)
                    log(f"  restart with {level} agents, rep {rep}: all back {r['listening_to_all_back_ms']:.0f} ms "
                        f"after the new relay's listening line ({r['sigterm_to_all_back_ms']:.0f} ms after SIGTERM; "
                        f"old relay exited in {r['old_exit_ms']:.0f} ms)")
    finally:
        stop_agents(agents)
        relay.stop()
    return out


# --------------------------------------------------------------------------------------
# Summary, charts, charts-data


def fmt(v, nd=1):
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def summarize(raw: dict) -> dict:
    s = {}
    tp = raw.get("throughput")
    if tp:
        rows = []
        labels = []
        for p in tp["points"]:
            if p["label"] not in labels:
                labels.append(p["label"])
        for lab in labels:
            pts = [p for p in tp["points"] if p["label"] == lab and "mb_s" in p]
            any_p = next(p for p in tp["points"] if p["label"] == lab)
            rows.append({"label": lab, "rtt_ms": any_p["rtt_ms"], "window_kib": any_p["window_kib"],
                         "expected_mb_s": any_p["expected_mb_s"], "mb_s": med([p["mb_s"] for p in pts]),
                         "mb_s_after_1s": med([p.get("mb_s_after_1s") for p in pts]),
                         "ratio": med([p.get("ratio_to_expected") for p in pts]),
                         "relay_cpu_ms_per_gb": med([p.get("relay_cpu_ms_per_gb") for p in pts]),
                         "agent_cpu_ms_per_gb": med([p.get("agent_cpu_ms_per_gb") for p in pts]),
                         "link_cpu_ms_per_gb": med([p.get("link_cpu_ms_per_gb") for p in pts]),
                         "first_byte_ms": med([p.get("first_byte_ms") for p in pts]),
                         "window_stalls": med([p.get("window_stalls") for p in pts]),
                         "n": len(pts)})
        s["throughput"] = rows
        s["throughput_direct_mb_s"] = med([r["mb_s"] for r in tp["references"]])
        # A window covers the RTT *and* the time to push the window itself through this box's
        # CPU-bound pipeline (agent, link, relay, client share 2 cores): W / (RTT + W / C), with
        # C the same run's ceiling through the link with no delay.
        ceiling = next((r["mb_s"] for r in rows if r["label"].startswith("tunnel, link with 0 ms")), None)
        s["throughput_ceiling_mb_s"] = ceiling
        for r in rows:
            if ceiling and isinstance(r["window_kib"], int) and r["rtt_ms"]:
                w = r["window_kib"] * 1024 / 1e6
                r["model_mb_s"] = w / (r["rtt_ms"] / 1000 + w / ceiling)
                r["ratio_to_model"] = r["mb_s"] / r["model_mb_s"] if r["mb_s"] else None
    lat = raw.get("latency")
    if lat:
        s["latency"] = lat["summary"]
    if raw.get("streams"):
        s["streams"] = {k: raw["streams"].get(k) for k in ("reading", "stalled", "resumed", "open_seconds", "idle_open",
                                                             "open_errors", "errors_total", "before", "after_close")}
    ag = raw.get("agents")
    if ag:
        s["agents"] = {"rss0_kib": ag.get("rss0_kib"),
                       "levels": [{k: r[k] for k in ("agents", "rss_kib", "per_agent_kib", "connect_seconds",
                                                    "agent_rss_kib_median_of_20")} for r in ag["levels"]],
                       "restarts": {}}
        for n in sorted({r["agents"] for r in ag["restarts"]}):
            rs = [r for r in ag["restarts"] if r["agents"] == n]
            s["agents"]["restarts"][n] = {
                "listening_to_all_back_ms_median": med([r["listening_to_all_back_ms"] for r in rs]),
                "listening_to_all_back_ms_max": max(r["listening_to_all_back_ms"] for r in rs),
                "sigterm_to_all_back_ms_median": med([r["sigterm_to_all_back_ms"] for r in rs]),
                "reps": len(rs)}
    return s


def tables(raw: dict, s: dict) -> list[str]:
    L = []
    if "throughput" in s:
        L += ["### One stream's throughput (COPY of 8 kB rows, time-bounded reads)", "",
              f"Direct to Postgres (no relay): {fmt(s['throughput_direct_mb_s'])} MB/s — the ceiling of this "
              "box for this client, with Postgres, client, relay, agent and link sharing 2 cores. "
              f"C = {fmt(s.get('throughput_ceiling_mb_s'))} MB/s: through relay, link (0 ms delay) and agent "
              "with a 16 MiB window.", "",
              "| path | RTT | window | window ÷ RTT (MB/s) | measured (MB/s) | after 1st s | measured ÷ expected | W ÷ (RTT + W ÷ C) | measured ÷ that | relay CPU ms/GB | agent CPU ms/GB | link CPU ms/GB | window stalls | runs |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in s["throughput"]:
            w = f"{r['window_kib']} KiB" if isinstance(r["window_kib"], int) else r["window_kib"]
            L.append(f"| {r['label']} | {r['rtt_ms']} ms | {w} | {fmt(r['expected_mb_s'])} | {fmt(r['mb_s'])} | "
                     f"{fmt(r['mb_s_after_1s'])} | {fmt(r['ratio'], 2)} | {fmt(r.get('model_mb_s'))} | {fmt(r.get('ratio_to_model'), 2)} | {fmt(r['relay_cpu_ms_per_gb'], 0)} | "
                     f"{fmt(r['agent_cpu_ms_per_gb'], 0)} | {fmt(r['link_cpu_ms_per_gb'], 0)} | {fmt(r['window_stalls'], 0)} | {r['n']} |")
        auto = raw["throughput"]["auto"]
        if not (auto["relay_binary"] and auto["agent_binary"]):
            L.append("| **TODO: auto-tuning** (`LOKADB_MUX_AUTO=1`) | 10, 40 ms | auto | — | — | — | — | — | — | — | — | — | — | 0 |")
            L += ["", f"Auto-tuning rows: TODO — `LOKADB_MUX_AUTO` is not read by the binaries benchmarked "
                  f"(source files mentioning it under proxy/ and agent/: {auto['source_files'] or 'none'}; "
                  f"in the relay binary: {auto['relay_binary']}, in the agent binary: {auto['agent_binary']}). "
                  "Re-run once it is wired: the script adds the rows by itself."]
        L.append("")
    if "latency" in s:
        L += ["### Added latency, no delay (one client, pgbench -c 1, medians over reps)", "",
              "| path | p50 direct | p50 through relay | added p50 | p99 direct | p99 through relay | added p99 | relay CPU µs/txn | agent CPU µs/txn |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        names = {"fdw tunnel": "postgres_fdw point read from the cloud db",
                 "client tunnel": "client point read (relay's Postgres listener vs org)"}
        for k, v in s["latency"].items():
            L.append(f"| {names.get(k, k)} | {fmt(v['p50_direct_ms'], 3)} | {fmt(v['p50_tunnel_ms'], 3)} | "
                     f"**{fmt(v['added_p50_ms'], 3)}** | {fmt(v['p99_direct_ms'], 3)} | {fmt(v['p99_tunnel_ms'], 3)} | "
                     f"{fmt(v['added_p99_ms'], 3)} | {fmt(v['relay_cpu_us_per_txn'])} | {fmt(v['agent_cpu_us_per_txn'])} |")
        L += ["", "Times in ms. Added = per-repetition difference of adjacent runs, median. Goal: ≤ 0.05 ms added.", ""]
    if "streams" in s:
        st = s["streams"]
        rd, sl, rs = st.get("reading") or {}, st.get("stalled") or {}, st.get("resumed") or {}
        L += [f"### {raw['streams'].get('streams')} streams through one agent ({raw['streams'].get('window_kib')} KiB window on relay and agent)", "",
              "| phase | relay VmRSS | relay VmHWM | note |", "|---|---:|---:|---|",
              f"| before | {fmt((st.get('before') or {}).get('VmRSS'))} KiB | {fmt((st.get('before') or {}).get('VmHWM'))} KiB | agent connected, no stream |",
              f"| logged in, idle | {fmt((st.get('idle_open') or {}).get('VmRSS'))} KiB | {fmt((st.get('idle_open') or {}).get('VmHWM'))} KiB | {raw['streams'].get('streams')} streams open, no query yet |",
              f"| reading | {fmt(rd.get('rss_kib'))} KiB | {fmt(rd.get('hwm_kib'))} KiB | {rd.get('streams_reading')} streams reading ({rd.get('streams_that_got_data')} got data), agent RSS {fmt(rd.get('agent_rss_kib'))} KiB, {fmt(rd.get('mb_s'))} MB/s in all, relay CPU {fmt(rd.get('relay_cpu_ms'), 0)} ms and agent CPU {fmt(rd.get('agent_cpu_ms'), 0)} ms in {rd.get('seconds')} s, relay received {fmt(rd.get('relay_bytes_from_agents'))} B from the agent (opening: {st.get('open_seconds')} s, {st.get('open_errors')} errors) |",
              f"| stalled | {fmt(sl.get('rss_kib'))} KiB | {fmt(sl.get('hwm_kib'))} KiB | no client reads for {sl.get('seconds')} s" + (f" — **stopped early: {sl.get('guard')}**" if sl.get("guard") else "") + f"; agent RSS {fmt(sl.get('agent_rss_kib'))} KiB" + f"; max_stream_buffered {fmt((sl.get('stats') or {}).get('max_stream_buffered'))} B |",
              f"| resumed | — | — | {rs.get('streams_alive')} streams alive, {fmt(rs.get('mb_s'))} MB/s |",
              f"| closed | {fmt((st.get('after_close') or {}).get('VmRSS'))} KiB | {fmt((st.get('after_close') or {}).get('VmHWM'))} KiB | 2 s after all closed |", ""]
    if "agents" in s:
        ag = s["agents"]
        L += ["### Relay RSS with idle agents (one organization each)", "",
              "| agents | relay RSS | (RSS(n) − RSS(0)) ÷ n | all connected after | one agent's RSS |",
              "|---:|---:|---:|---:|---:|",
              f"| 0 | {fmt(ag['rss0_kib'])} KiB | — | — | — |"]
        for r in ag["levels"]:
            L.append(f"| {r['agents']} | {fmt(r['rss_kib'])} KiB | **{fmt(r['per_agent_kib'])} KiB** | "
                     f"{r['connect_seconds']} s | {fmt(r['agent_rss_kib_median_of_20'])} KiB |")
        L += ["", "Goal: ≤ 50 KiB per idle agent.", "",
              "### Relay restart: until every agent has a tunnel again", "",
              "| agents | from new relay's listening line (median) | (max) | from SIGTERM (median) | reps |",
              "|---:|---:|---:|---:|---:|"]
        for n, r in ag["restarts"].items():
            L.append(f"| {n} | **{fmt(r['listening_to_all_back_ms_median'], 0)} ms** | "
                     f"{fmt(r['listening_to_all_back_ms_max'], 0)} ms | {fmt(r['sigterm_to_all_back_ms_median'], 0)} ms | {r['reps']} |")
        L += ["", "Goal: ≤ 1 s.", ""]
    return L


def summary_markdown(raw: dict, s: dict) -> str:
    m = raw["meta"]
    L = [f"# Tunnel benchmark, {m['mode']} mode — run {m['run_id']}", "",
         f"Commit `{m['git']['commit'][:12]}`{' (dirty tree)' if m['git']['dirty'] else ''}, "
         f"{m['machine']['nproc']} cores, load average at start {m['machine']['loadavg_at_start']}, "
         f"{m.get('wall_seconds', 0):.0f} s. Binaries: `{bin_dir_of(m, BIN_DIR)}`.", ""]
    L += tables(raw, s)
    if m["errors"]:
        L += ["### Errors", ""] + [f"- {e}" for e in m["errors"]] + [""]
    return "\n".join(L)


# The goals (RESULTS.md's overview, rows "Tunnel"): p50 added by relay + tunnel + agent ≤ 0.05 ms
# (a client's point read), ≤ 50 KiB of relay memory per idle agent, every agent back ≤ 1 s after
# a relay restart. The reference (shared/seed/performance-reference.txt, "Failures" and "Improved
# after these measurements"; RESULTS.md, the same rows): the relay held 100 agents in 34 MB, and
# a relay restart took about 60–77 s until the agents were back, before its fix. It has no
# figure for the added latency or one stream's throughput.
GOAL_ADDED_P50_MS = 0.05
GOAL_KIB_PER_AGENT = 50
GOAL_RESTART_MS = 1000
REFERENCE_AGENTS_RSS = (100, 34e6)  # (agents, relay bytes)
REFERENCE_RESTART_MS = (60000, 77000)


def draw_charts(outdir: Path, raw: dict, s: dict) -> list[str]:
    made = []
    run_of = f"{raw['meta']['mode']} mode, run {raw['meta']['run_id']}"
    if s.get("throughput"):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
        for ax, rtt in zip(axes, raw["meta"]["mode_settings"]["rtts_ms"]):
            rows = [r for r in s["throughput"] if r["rtt_ms"] == rtt and isinstance(r["window_kib"], int)]
            x = range(len(rows))
            ax.bar([i - 0.2 for i in x], [r["expected_mb_s"] for r in rows], 0.4, label="window ÷ RTT", color="#bbb")
            ax.bar([i + 0.2 for i in x], [r["mb_s"] or 0 for r in rows], 0.4, label="measured", color="#3a7")
            ax.set_xticks(list(x), [f"{r['window_kib']} KiB" for r in rows])
            ax.set_yscale("log")
            ax.set_title(f"{rtt} ms RTT")
            ax.set_xlabel("multiplexer window per stream")
            ax.set_ylabel("MB/s (log)")
            if s.get("throughput_direct_mb_s"):
                ax.axhline(s["throughput_direct_mb_s"], ls=":", color="#57606a", lw=1, label="direct to Postgres")
            ax.legend(fontsize=8)
        fig.suptitle(f"One stream's throughput through relay + latency link + agent ({run_of})", fontsize=10)
        fig.tight_layout()
        save_png(fig, outdir / "tunnel-throughput.png", 110)
        plt.close(fig)
        made.append("tunnel-throughput.png")
    if s.get("latency"):
        fig, ax = plt.subplots(figsize=(7, 4))
        keys = list(s["latency"])
        ax.bar(range(len(keys)), [s["latency"][k]["added_p50_ms"] or 0 for k in keys], 0.5, color="#37a")
        goal_line(ax, GOAL_ADDED_P50_MS, f"≤ {GOAL_ADDED_P50_MS:g} ms added (client point read)")
        for i, k in enumerate(keys):
            v = s["latency"][k]["added_p50_ms"]
            if v is not None:
                ax.text(i, v, f"+{v:.3f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(keys)), ["postgres_fdw point read", "client point read"])
        ax.set_ylabel("p50 added over direct, ms")
        ax.set_title(f"p50 added by relay + tunnel + agent, no delay ({run_of})", fontsize=9)
        ax.legend()
        fig.tight_layout()
        save_png(fig, outdir / "tunnel-added-latency.png", 110)
        plt.close(fig)
        made.append("tunnel-added-latency.png")
    if s.get("agents"):
        ag = s["agents"]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        xs = [0] + [r["agents"] for r in ag["levels"]]
        ys = [ag["rss0_kib"] / 1024] + [r["rss_kib"] / 1024 for r in ag["levels"]]
        axes[0].plot(xs, ys, "o-", label="relay RSS, measured")
        gx = [0] + [k * 10 ** e for e in range(6) for k in (1, 2, 5) if k * 10 ** e <= max(xs)]
        axes[0].plot(gx, [ag["rss0_kib"] / 1024 + GOAL_KIB_PER_AGENT * n / 1024 for n in gx],
                     color=GOAL_STYLE["colors"], ls="--", lw=GOAL_STYLE["linewidths"],
                     label=f"goal: ≤ {GOAL_KIB_PER_AGENT} KiB per idle agent (over RSS with none)")
        n_ref, b_ref = REFERENCE_AGENTS_RSS
        axes[0].plot([n_ref], [b_ref / 2 ** 20], "X", color=REFERENCE_STYLE["colors"], ms=8,
                     label=f"reference: {n_ref} agents in {b_ref / 1e6:g} MB")
        axes[0].set_xscale("symlog", linthresh=10)
        axes[0].set_xlabel("idle agents")
        axes[0].set_ylabel("relay RSS (MiB)")
        for r in ag["levels"]:
            axes[0].annotate(f"{r['per_agent_kib']:.0f} KiB/agent", (r["agents"], r["rss_kib"] / 1024),
                             fontsize=8, textcoords="offset points", xytext=(-40, 8))
        axes[0].set_title("Relay RSS with idle agents")
        axes[0].legend(fontsize=7, loc="upper left")
        ns = list(ag["restarts"])
        vals = [ag["restarts"][n]["listening_to_all_back_ms_median"] for n in ns]
        axes[1].bar(range(len(ns)), vals, 0.5)
        for i, v in enumerate(vals):
            axes[1].text(i, v, f"{v:,.0f} ms", ha="center", va="bottom", fontsize=8)
        lo, hi = REFERENCE_RESTART_MS
        axes[1].axhspan(lo, hi, color="grey", alpha=0.35, label=f"reference: {lo / 1000:g}–{hi / 1000:g} s, "
                                                                 "before its fix")
        goal_line(axes[1], GOAL_RESTART_MS, f"≤ {GOAL_RESTART_MS / 1000:g} s")
        axes[1].set_yscale("log")
        axes[1].set_ylim(10, hi * 40)
        axes[1].set_xticks(range(len(ns)), [f"{n} agents" for n in ns])
        axes[1].set_ylabel("ms from new relay listening to all back (log)")
        axes[1].set_title("Relay restart: until every agent is back (median)")
        axes[1].legend(fontsize=7, loc="upper left")
        fig.suptitle(f"Tunnel: relay memory and restart with idle agents ({run_of})", fontsize=10)
        fig.tight_layout()
        save_png(fig, outdir / "tunnel-agents.png", 110)
        plt.close(fig)
        made.append("tunnel-agents.png")
    if raw.get("streams", {}).get("samples"):
        sm = raw["streams"]["samples"]
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot([x["t"] for x in sm], [(x["rss_kib"] or 0) / 1024 for x in sm], label="VmRSS")
        ax.plot([x["t"] for x in sm], [(x["hwm_kib"] or 0) / 1024 for x in sm], label="VmHWM", ls="--")
        for ph in ("reading", "stalled", "resumed"):
            ts = [x["t"] for x in sm if x["phase"] == ph]
            if ts:
                ax.axvspan(min(ts), max(ts), alpha=0.1, color={"reading": "g", "stalled": "r", "resumed": "b"}[ph])
                ax.text(min(ts), 0, ph, fontsize=8)
        ax.set_xlabel("seconds from the scenario's start")
        ax.set_ylabel("relay memory, MiB")
        ax.set_title(f"Relay memory, {raw['streams'].get('streams')} streams (opening, reading, stalled, resumed)\n"
                     f"({run_of})", fontsize=10)
        ax.legend()
        fig.tight_layout()
        save_png(fig, outdir / "tunnel-streams-memory.png", 110)
        plt.close(fig)
        made.append("tunnel-streams-memory.png")
    return made


def update_charts_data(raw: dict, s: dict, outdir: Path, charts: list[str]) -> None:
    m = raw["meta"]
    mode = m["mode"]
    rel = f"results/{outdir.name}"
    body = [f"## Tunnel, {mode} mode" + (" — short runs; indicative only" if mode == "quick" else ""), "",
            f"Run `{outdir.name}` (folder `{rel}/`), commit `{m['git']['commit'][:12]}`"
            f"{' (dirty tree)' if m['git']['dirty'] else ''}, {m['machine']['nproc']} cores, written by "
            f"`research/bench/tunnel.py`. Charts: " + ", ".join(f"`{rel}/{c}`" for c in charts) + ".", ""]
    body += tables(raw, s)
    write_charts_section(f"tunnel {mode}", "\n".join(body).rstrip("\n"))


# --------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs, R=1 (≈ 1.7 min)")
    ap.add_argument("--out", type=Path, help="result folder (default results/<UTC ts>-tunnel[-quick])")
    ap.add_argument("--only", default="throughput,streams,latency,agents",
                    help="comma-separated scenarios (default: all)")
    ap.add_argument("--no-charts-data", action="store_true", help="leave charts-data.md alone")
    ap.add_argument("--streams", type=int, help="streams of the streams scenario (default 2048)")
    ap.add_argument("--render", type=Path, help="only rebuild summary.md, charts and charts-data.md from this raw.json or raw.json.gz")
    args = ap.parse_args()
    if args.render:
        raw = read_raw(args.render)
        outdir = args.render.parent
        s = summarize(raw)
        raw["summary"] = s
        write_raw_gz(outdir, raw)
        md = summary_markdown(raw, s)
        (outdir / "summary.md").write_text(md)
        charts = draw_charts(outdir, raw, s)
        if not args.no_charts_data:
            update_charts_data(raw, s, outdir, charts)
        print(md)
        return 0
    preflight("tunnel.py", (PG_BIN / "postgres", PG_BIN / "pgbench", LOKADB_BIN, AGENT_BIN, LINK_BIN))
    only = set(args.only.split(","))
    mode = Mode(args.quick)
    if args.streams:
        mode.streams = args.streams
    started, run_id, outdir = result_dir(args.out, "-tunnel", mode.quick)
    raise_fd_limit()
    catch_signals()

    ctx = Ctx(mode)
    meta = {"run_id": run_id, "mode": mode.name, "started_utc": started.isoformat(),
            "mode_settings": dict(vars(mode)), "scenarios": sorted(only),
            "machine": machine_info(), "git": git_info(),
            "binaries": {b.name: binary_info(b) for b in (LOKADB_BIN, AGENT_BIN, LINK_BIN)},
            "copy_sql": COPY_SQL, "setup_commands": ctx.commands, "errors": ctx.errors}
    raw = {"meta": meta}
    t_start = time.time()
    rc = 0
    try:
        ctx.tmp = temp_dir("lokadb-tunnel-bench-")
        ctx.certs = make_certs(ctx.tmp, ctx.commands)
        log(f"mode={mode.name} out={outdir}; start the org cluster (max_connections 2200) and the cloud cluster")
        ctx.org = Cluster(ctx.tmp, "org", {"max_connections": "2200", "shared_buffers": "128MB"}, ctx.commands)
        with ctx.org.conn() as c:
            c.execute(f"CREATE ROLE app LOGIN PASSWORD '{APP_PASSWORD}'")
            c.execute("CREATE ROLE raw LOGIN")
            c.execute(f"CREATE DATABASE {ORG_DB} OWNER app")
            meta["postgres_version"] = c.execute("SELECT version()").fetchone()[0]
        with ctx.org.conn(ORG_DB, user="app", password=APP_PASSWORD) as c:
            c.execute("CREATE TABLE items (id int PRIMARY KEY, body text)")
            c.execute(f"INSERT INTO items SELECT g, 'row ' || g FROM generate_series(1, {ITEMS}) g")
            c.execute("VACUUM ANALYZE items")
        ctx.cloud = Cluster(ctx.tmp, "cloud", {"max_connections": "100"}, ctx.commands)
        with ctx.cloud.conn() as c:
            c.execute(f"CREATE ROLE app LOGIN PASSWORD '{APP_PASSWORD}'")
            c.execute("CREATE DATABASE app OWNER app")
        with ctx.cloud.conn("app") as c:
            c.execute("CREATE EXTENSION postgres_fdw")
            c.execute("GRANT USAGE ON FOREIGN DATA WRAPPER postgres_fdw TO app")
        for name, fn in (("throughput", scenario_throughput), ("latency", scenario_latency),
                         ("streams", scenario_streams), ("agents", scenario_agents)):
            if name not in only:
                continue
            log(f"scenario {name}")
            t0 = time.time()
            try:
                raw[name] = fn(ctx)
                raw[name]["wall_seconds"] = round(time.time() - t0, 1)
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001
                ctx.errors.append(f"scenario {name} failed: {e!r}")
                raw[name + "_traceback"] = traceback.format_exc()
                log(f"scenario {name} FAILED: {e!r}")
                traceback.print_exc()
                rc = 1
    except KeyboardInterrupt as e:
        ctx.errors.append(f"interrupted: {e}")
        rc = 130
    finally:
        cleanup()
        meta["wall_seconds"] = round(time.time() - t_start, 1)
        meta["loadavg_at_end"] = Path("/proc/loadavg").read_text().strip()
        s = summarize(raw)
        raw["summary"] = s
        (outdir / "raw.json").write_text(json.dumps(raw, indent=1, default=str))
        md = write_outputs(raw, s, outdir, not args.no_charts_data and not args.out, summary_markdown,
                           draw_charts, update_charts_data)
        print(md)
        log(f"results in {outdir}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
