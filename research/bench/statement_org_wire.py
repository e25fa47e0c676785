#!/usr/bin/env python3
"""What each way of setting a value ahead of a statement costs one Postgres backend, measured
at the wire: one client, no proxy, one request at a time, the backend's CPU per operation.

    .venv/bin/python research/bench/statement_org_wire.py [--quick]

It answers which form `lokadb.statement_org` can take (issue 6, "the cloud learns the
organization"): the proxy's Bind and Execute of `set_config` ahead of the client's statement,
with a Sync of their own or inside the client's batch, or other forms of the same work. A
statement reads one row of a 1000-row table by its key; each variant sets the value to a
new one every time (as at 1000 organizations). Variants:

- `simple`: the client's simple Query alone (the baseline of the next three);
- `simple+own`: the proxy's Bind, Execute, Sync, then the Query (what the proxy sends);
- `simple multi`: `SELECT set_config(…); <statement>` as one Query;
- `simple as extended`: the proxy's Bind and Execute, then the Query's text as Parse, Bind,
  Describe, Execute, Sync (a Query cannot follow Bind and Execute without a Sync: PostgreSQL
  18 leaves the transaction open, and a failing Query gets an internal error);
- `prepared`: Bind, Execute, Sync of a prepared statement alone (the baseline of the next two);
- `prepared+own`: the proxy's Bind, Execute, Sync, then the client's batch;
- `prepared folded`: the proxy's Bind and Execute at the front of the client's batch.

The backend's CPU is read from /proc (user + system, clock ticks) around N operations; the
variants alternate, R repetitions, medians reported. The differences, not the absolute
figures (which include waking the backend for every request), are what this measures.

Writes raw.json and summary.md into research/bench/results/<UTC ts>-statement-org-wire[-quick]/.
"""

import argparse
import os
import shlex
import socket
import struct
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lib.binaries import PG_BIN  # noqa: E402
from lib.clusters import PgCluster, cluster_root  # noqa: E402
from lib.numbers import fmt, med  # noqa: E402
from lib.procs import catch_signals, ignore_signals, log, preflight, safe_cleanup, temp_dir  # noqa: E402
from lib.results import (  # noqa: E402
    fatal, finish_run, git_info, machine_info, rerender, result_dir, write_empty_summary, write_summary,
)

SET_SQL = "SELECT pg_catalog.set_config('lokadb.statement_org', $1, false)"
ROWS = 1000
TICK = os.sysconf("SC_CLK_TCK")


def frame(tag: bytes, body: bytes) -> bytes:
    return tag + struct.pack("!I", len(body) + 4) + body


def cstr(s: str) -> bytes:
    return s.encode() + b"\0"


def parse(name: str, sql: str) -> bytes:
    return frame(b"P", cstr(name) + cstr(sql) + struct.pack("!H", 0))


def bind(portal: str, statement: str, values: list[str]) -> bytes:
    body = cstr(portal) + cstr(statement) + struct.pack("!HH", 0, len(values))
    for v in values:
        body += struct.pack("!I", len(v)) + v.encode()
    return frame(b"B", body + struct.pack("!H", 0))


def execute(portal: str) -> bytes:
    return frame(b"E", cstr(portal) + struct.pack("!I", 0))


def close_portal(name: str) -> bytes:
    return frame(b"C", b"P" + cstr(name))


SYNC = frame(b"S", b"")
DESCRIBE_UNNAMED = frame(b"D", b"P\0")


def query(sql: str) -> bytes:
    return frame(b"Q", cstr(sql))


def own(org: str) -> bytes:
    """The proxy's messages: Close of its portal, Bind and Execute of its statement."""
    return close_portal("o") + bind("o", "o", [org]) + execute("o")


def statement(i: int) -> str:
    return f"SELECT b FROM t WHERE a = {i % ROWS + 1}"


# name: (the bytes of operation i, ReadyForQuery messages it gets)
VARIANTS = {
    "simple": (lambda i: query(statement(i)), 1),
    "simple+own": (lambda i: own(str(i)) + SYNC + query(statement(i)), 2),
    "simple multi": (lambda i: query(f"SELECT pg_catalog.set_config('lokadb.statement_org', '{i}', false); "
                                     + statement(i)), 1),
    "simple as extended": (lambda i: own(str(i)) + parse("", statement(i)) + bind("", "", [])
                           + DESCRIBE_UNNAMED + execute("") + SYNC, 1),
    "prepared": (lambda i: bind("", "q", [str(i % ROWS + 1)]) + execute("") + SYNC, 1),
    "prepared+own": (lambda i: own(str(i)) + SYNC + bind("", "q", [str(i % ROWS + 1)]) + execute("") + SYNC, 2),
    "prepared folded": (lambda i: own(str(i)) + bind("", "q", [str(i % ROWS + 1)]) + execute("") + SYNC, 1),
}


class Conn:
    """A raw protocol connection, over the cluster's Unix socket or TCP on 127.0.0.1 (the
    proxy's way to the cloud), trusted."""

    def __init__(self, socket_dir: Path, port: int, transport: str):
        if transport == "unix":
            self.s = socket.socket(socket.AF_UNIX)
            self.s.connect(str(socket_dir / f".s.PGSQL.{port}"))
        else:
            self.s = socket.create_connection(("127.0.0.1", port))
            self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        body = struct.pack("!I", 196608) + cstr("user") + cstr("postgres") + cstr("database") + cstr("postgres") + b"\0"
        self.s.sendall(struct.pack("!I", len(body) + 4) + body)
        self.buf = b""
        self.errors = []
        self.answers(1)

    def answers(self, ready: int) -> list[tuple[str, bytes]]:
        out = []
        while ready:
            while len(self.buf) < 5 or len(self.buf) < 1 + struct.unpack("!I", self.buf[1:5])[0]:
                data = self.s.recv(65536)
                if not data:
                    raise RuntimeError("the backend closed the connection")
                self.buf += data
            n = struct.unpack("!I", self.buf[1:5])[0]
            tag, body, self.buf = chr(self.buf[0]), self.buf[5:1 + n], self.buf[1 + n:]
            if tag == "E":
                self.errors.append(body.decode(errors="replace"))
            out.append((tag, body))
            if tag == "Z":
                ready -= 1
        return out

    def run(self, data: bytes, ready: int = 1):
        self.s.sendall(data)
        return self.answers(ready)


def backend_cpu(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TICK


def render(raw: dict, outdir: Path, charts_data: bool) -> str:
    del charts_data  # a cost check, not a chart
    runs = raw["runs"]
    if not runs:
        return write_empty_summary(raw, outdir, "statement_org wire benchmark", "measured run")
    m = raw["meta"]
    base = {"simple": "simple", "simple+own": "simple", "simple multi": "simple",
            "simple as extended": "simple", "prepared": "prepared", "prepared+own": "prepared",
            "prepared folded": "prepared"}
    rows = ["| transport | variant | backend µs/op (median) | − its baseline | runs |",
            "|---|---|---:|---:|---|"]
    for transport in m["transports"]:
        by = {v: [r["backend_us_per_op"] for r in runs if (r["variant"], r["transport"]) == (v, transport)]
              for v in VARIANTS}
        for v, xs in by.items():
            if not xs:
                continue
            b = med(by[base[v]]) if by[base[v]] else None
            diff = "" if v == base[v] or b is None else fmt(med(xs) - b, 1)
            rows.append(f"| {transport} | {v} | {fmt(med(xs), 1)} | {diff} | {', '.join(fmt(x, 1) for x in xs)} |")
    md = (f"# statement_org wire benchmark — run {m['run_id']}\n\n"
          f"Commit `{m['git']['commit'][:12]}`{' (dirty tree)' if m['git']['dirty'] else ''}, "
          f"{m['wall_seconds']} s, {m['postgres_version']}. Command: `{m['command']}`.\n\n"
          f"One raw-protocol client (over the Unix socket, then TCP on 127.0.0.1), one request at a time, N = {m['n']:,} "
          f"operations per run, R = {m['reps']}, the variants alternating; the backend's CPU "
          f"(user + system) per operation.\n\n" + "\n".join(rows) + "\n")
    return write_summary(outdir, md, m["errors"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N = 10,000, R = 3 (≈ 1 min)")
    ap.add_argument("--out", type=Path, help="result folder (default results/<UTC ts>-statement-org-wire[-quick])")
    ap.add_argument("--render", type=Path, help="only rebuild summary.md from this raw.json or raw.json.gz")
    ap.add_argument("--transports", default="unix,tcp", help="comma-separated: unix, tcp (default both)")
    args = ap.parse_args()
    if args.render:
        return rerender(args.render, render, False)
    preflight("statement_org_wire.py", (PG_BIN / "postgres",))
    n, reps = (10_000, 3) if args.quick else (30_000, 5)
    started, run_id, outdir = result_dir(args.out, "-statement-org-wire", args.quick)
    catch_signals()
    commands: list = []
    errors: list = []
    transports = args.transports.split(",")
    if any(t not in ("unix", "tcp") for t in transports):
        ap.error("--transports: unix and/or tcp")
    meta = {"run_id": run_id, "started_utc": started.isoformat(), "n": n, "reps": reps,
            "transports": transports,
            "command": ".venv/bin/python research/bench/statement_org_wire.py " + shlex.join(sys.argv[1:]),
            "machine": machine_info(), "git": git_info(), "setup_commands": commands,
            "errors": errors}
    raw = {"meta": meta, "runs": []}
    t_start = time.time()
    rc = 0
    try:
        tmp = temp_dir("lokadb-statement-org-wire-")
        pg = PgCluster(cluster_root(tmp / "clusters"), "cloud", commands)
        pg.initdb()
        # The raw client speaks no SCRAM: trust on 127.0.0.1 too (a throwaway cluster).
        hba = pg.data / "pg_hba.conf"
        hba.write_text("host all postgres 127.0.0.1/32 trust\n" + hba.read_text())
        commands.append(f"(prepended to {hba}) host all postgres 127.0.0.1/32 trust")
        pg.start({"autovacuum": "off"})
        meta["postgres_version"] = pg.one("SELECT version()", dbname="postgres")
        for transport in transports:
            c = Conn(pg.dir, pg.port, transport)
            pid = int(c.run(query("SELECT pg_backend_pid()"))[1][1][6:].decode())
            c.run(query(f"DROP TABLE IF EXISTS t; CREATE TABLE t (a int PRIMARY KEY, b text); INSERT INTO t "
                        f"SELECT g, 'x' FROM generate_series(1, {ROWS}) g; ANALYZE t"))
            c.run(parse("o", SET_SQL) + parse("q", "SELECT b FROM t WHERE a = $1") + SYNC)
            for rep in range(reps):
                order = list(VARIANTS) if rep % 2 == 0 else list(VARIANTS)[::-1]
                for v in order:
                    make, ready = VARIANTS[v]
                    for i in range(500):  # warm: plans cached, pages in memory
                        c.run(make(i), ready)
                    before, t0 = backend_cpu(pid), time.time()
                    for i in range(n):
                        c.run(make(i), ready)
                    cpu, wall = backend_cpu(pid) - before, time.time() - t0
                    raw["runs"].append({"transport": transport, "variant": v, "rep": rep, "n": n,
                                        "backend_us_per_op": 1e6 * cpu / n, "wall_us_per_op": 1e6 * wall / n})
                    log(f"  {transport} {v:20s} rep {rep}: backend {1e6 * cpu / n:6.1f} µs/op, "
                        f"wall {1e6 * wall / n:6.1f}")
            if c.errors:
                errors.extend(c.errors[:5])
                rc = 1
    except KeyboardInterrupt as e:
        errors.append(f"interrupted: {e}")
        rc = 130
    except Exception as e:  # noqa: BLE001
        rc = fatal(errors, e)
    finally:
        ignore_signals()
        safe_cleanup()
        finish_run(raw, outdir, t_start, render, False)
    return rc


if __name__ == "__main__":
    sys.exit(main())
