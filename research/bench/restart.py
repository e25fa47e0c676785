#!/usr/bin/env python3
"""Restarts and reloads under load: what a client of the proxy sees.

    LOKADB_BENCH_TARGET=/work/main/target/release .venv/bin/python research/bench/restart.py [--quick] [--out DIR]

1. Rolling restart with `handover`: pgbench (16 clients, the `read` and `update` scripts) runs
   through the proxy while a new `lokadb proxy` with the same config is started every few
   seconds; each takes the running one's listening sockets, which then drains and exits.
   - `-C` (a new connection per transaction: the clients a restart must not refuse): errors
     (aborted clients, failed transactions) and the longest transaction, around the restarts
     and elsewhere.
   - persistent connections: the old process ends each of its sessions at a transaction
     boundary after its 500 ms grace, and pgbench (which does not reconnect) loses those
     clients: reported as measured, to say what a pool that does not reconnect meets.
2. Reload: pgbench (16 persistent clients) through two runs side by side in alternating
   order, one with a SIGHUP every second, one without: tps and p99 with ÷ without, longest
   transaction.

Writes raw.json.gz and summary.md into research/bench/results/<UTC ts>-restart[-quick]/ (or
--out); --render RAW writes summary.md again from a run's raw.json[.gz].
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lib.binaries import PG_BIN  # noqa: E402
from lib.numbers import percentile  # noqa: E402
from lib.procs import CHILDREN, catch_signals, log, preflight, raise_fd_limit  # noqa: E402
from lib.results import Ctx, guarded_run, rerender, result_dir, run_meta, write_empty_summary  # noqa: E402
from lib.three_targets import (  # noqa: E402
    APP_PASSWORD, AUTH_PASSWORD, LOKADB_BIN, ORGS, SCRIPTS, Mode, World, binary_info,
)


class Proxy:
    """One `lokadb proxy` process on a config file (shared by the processes that hand over)."""

    def __init__(self, cfg: Path, logfile: Path):
        env = dict(os.environ, LOKADB_LOG="info")
        self.cmd = [str(LOKADB_BIN), "proxy", "--config", str(cfg)]
        self.p = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=open(logfile, "ab"),
                                  stdin=subprocess.DEVNULL, env=env, start_new_session=True, text=True)
        CHILDREN.append(self.p)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(l) for l in self.p.stdout] and lines.put(None),
                         daemon=True).start()
        deadline = time.time() + 30
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.time()))
            if line is None:
                raise RuntimeError("lokadb exited before listening: " + logfile.read_text()[-2000:])
            m = re.search(r"lokadb proxy listening on \S+:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                self.started = time.time()
                return


def config(w: World, tmp: Path, handover: bool) -> Path:
    cfg = {
        "listen": "127.0.0.1:0",
        "databases": {"app": {
            "cloud": f"host=127.0.0.1 port={w.pg_port} dbname=app",
            "auth_user": "lokadb_auth",
            "auth_password": AUTH_PASSWORD,
        }},
    }
    if handover:
        cfg["handover"] = str(tmp / "handover.sock")
    path = tmp / ("handover.json" if handover else "plain.json")
    path.write_text(json.dumps(cfg, indent=2))
    return path


def pgbench(port: int, script: Path, clients: int, seconds: int, connect_each: bool, logdir: Path):
    """Starts pgbench (per-transaction log with timestamps); returns (Popen, command)."""
    cmd = [str(PG_BIN / "pgbench"), "-n", "-h", "127.0.0.1", "-p", str(port), "-U", "app",
           "-f", str(script), "-c", str(clients), "-j", "2", "-T", str(seconds), "-l",
           f"--log-prefix={logdir}/txn"]
    if connect_each:
        cmd.append("-C")
    cmd.append("app")
    env = dict(os.environ, PGPASSWORD=APP_PASSWORD, PGSSLMODE="disable")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return p, "PGPASSWORD=*** " + shlex.join(cmd)


def transactions(logdir: Path):
    """(end time s, latency ms) of every logged transaction."""
    out = []
    for f in logdir.glob("txn.*"):
        for line in f.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 6 and parts[2].isdigit():
                end = int(parts[4]) + int(parts[5]) / 1e6
                out.append((end, int(parts[2]) / 1000))
    return out


def result(p: subprocess.Popen, logdir: Path, events: list[float]) -> dict:
    stdout, stderr = p.communicate(timeout=300)
    tx = transactions(logdir)
    lat = sorted(l for _, l in tx)
    near = [l for end, l in tx if any(e - 1 <= end - l / 1000 <= e + 2 for e in events)]
    aborted = len(re.findall(r"client \d+ (?:script \d+ )?aborted", stderr))
    m = re.search(r"number of failed transactions: (\d+)", stdout)
    return {
        "transactions": len(tx),
        "tps": float(re.search(r"^tps = ([\d.]+)", stdout, re.M).group(1)) if "tps =" in stdout else None,
        "aborted_clients": aborted,
        "failed_transactions": int(m.group(1)) if m else None,
        "errors": aborted + (int(m.group(1)) if m else 0),
        "p50_ms": round(percentile(lat, 0.5), 3) if lat else None,
        "p99_ms": round(percentile(lat, 0.99), 3) if lat else None,
        "max_ms": round(lat[-1], 3) if lat else None,
        "max_ms_near_restarts": round(max(near), 3) if near else None,
        "first_errors": [l for l in stderr.splitlines() if "abort" in l or "FATAL" in l or "ERROR" in l][:5],
        "returncode": p.returncode,
    }


def rolling(w: World, tmp: Path, scripts: dict, mode: Mode, connect_each: bool, script: str,
            restart: bool) -> dict:
    cfg = config(w, tmp, handover=True)
    seconds = 6 if mode.quick else 30  # quick: 2 restarts (at ~2 s and ~4 s), full: 5
    every = 2 if mode.quick else 5
    proc = Proxy(cfg, tmp / "proxy.log")
    logdir = Path(tempfile.mkdtemp(prefix="pgb-", dir=tmp))
    bench, cmd = pgbench(proc.port, scripts[script], 16, seconds, connect_each, logdir)
    events, restarts = [], []
    t0 = time.time()
    while restart and time.time() - t0 < seconds - every:
        time.sleep(every)
        started = time.time()
        nxt = Proxy(cfg, tmp / "proxy.log")
        assert nxt.port == proc.port, (nxt.port, proc.port)
        events.append(started)
        try:
            proc.p.wait(timeout=60)
            exited = round(time.time() - started, 3)
        except subprocess.TimeoutExpired:
            exited = None
        restarts.append({"new_listening_after_s": round(nxt.started - started, 3),
                         "old_exited_after_s": exited, "old_exit_code": proc.p.returncode})
        proc = nxt
    rec = result(bench, logdir, events)
    rec.update({"scenario": "handover", "script": script, "connect_each": connect_each, "restart": restart,
                "clients": 16, "seconds": seconds, "restarts": restarts, "command": cmd,
                "restart_command": shlex.join(proc.cmd) + "   (a second process on the same config)"})
    proc.p.send_signal(signal.SIGTERM)
    proc.p.wait(timeout=60)
    log(f"  {'handover' if restart else 'baseline'} {script} {'-C' if connect_each else 'persistent'}: {len(restarts)} restarts, "
        f"errors={rec['errors']} max={rec['max_ms']} ms near restarts={rec['max_ms_near_restarts']} ms "
        f"p99={rec['p99_ms']} ms")
    return rec


def reload_runs(w: World, tmp: Path, scripts: dict, mode: Mode) -> list[dict]:
    cfg = config(w, tmp, handover=False)
    proc = Proxy(cfg, tmp / "reload.log")
    seconds = 2 if mode.quick else 10
    runs = []
    # Alternating order, so drift on the shared machine falls on both alike.
    order = ["sighup", "steady", "steady", "sighup"] * (1 if mode.quick else 2)
    for variant in order:
        for script in ("read", "update"):
            logdir = Path(tempfile.mkdtemp(prefix="pgb-", dir=tmp))
            bench, cmd = pgbench(proc.port, scripts[script], 16, seconds, False, logdir)
            hups = []
            if variant == "sighup":
                t0 = time.time()
                while bench.poll() is None and time.time() - t0 < seconds - 0.5:
                    time.sleep(1)
                    proc.p.send_signal(signal.SIGHUP)
                    hups.append(time.time())
            rec = result(bench, logdir, hups)
            rec.update({"scenario": "reload", "variant": variant, "script": script, "seconds": seconds,
                        "sighups": len(hups), "command": cmd})
            runs.append(rec)
            log(f"  reload {variant:<6} {script:<6} tps={rec['tps']} p99={rec['p99_ms']} ms "
                f"max={rec['max_ms']} ms sighups={len(hups)} errors={rec['errors']}")
    proc.p.send_signal(signal.SIGTERM)
    proc.p.wait(timeout=60)
    return runs


def summary(raw: dict) -> str:
    meta = raw["meta"]
    md = [f"# Restarts and reloads under pgbench — run {meta['run_id']}", "",
          f"Command: `{meta['command']}`. {meta.get('postgres_version', '?')}; proxy, Postgres and pgbench "
          "share the machine's 2 cores.", "",
          "## Rolling restart with `handover`", "",
          "Each row's run with restarts follows the same run without any (baseline, same process "
          "otherwise), so the latencies compare side by side.", "",
          "| script | connections | restarts | transactions | errors (aborted clients + failed) | p99 ms (baseline) | longest ms (baseline) | longest within 1 s before – 2 s after a restart, ms | new process listening after, s | old process exited after, s |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in raw["runs"]:
        if r["scenario"] != "handover":
            continue
        key = (r["script"], r["connect_each"])
        if not r.get("restart"):
            base[key] = r
            continue
        b = base.get(key, {})
        listen = ", ".join(f"{x['new_listening_after_s']}" for x in r["restarts"])
        gone = ", ".join(f"{x['old_exited_after_s']}" for x in r["restarts"])
        md.append(f"| {r['script']} | {'new per transaction (-C)' if r['connect_each'] else 'persistent'} | "
                  f"{len(r['restarts'])} | {r['transactions']} | {r['errors']} | {r['p99_ms']} ({b.get('p99_ms')}) | "
                  f"{r['max_ms']} ({b.get('max_ms')}) | "
                  f"{r['max_ms_near_restarts']} | {listen} | {gone} |")
    md += ["", "Persistent clients: the old process ends each session it holds at its first point outside a "
           "transaction 500 ms after the handover (FATAL 57P01); pgbench does not reconnect, so each such "
           "client is counted aborted. A pool that reconnects on 57P01 meets it once per connection.", "",
           "## Reload (SIGHUP every second) against none, side by side", "",
           "| script | tps with ÷ without | p99 with ÷ without | longest ms with / without | SIGHUPs | errors |",
           "|---|---|---|---|---|---|"]
    for script in ("read", "update"):
        w = [r for r in raw["runs"] if r["scenario"] == "reload" and r["script"] == script and r["variant"] == "sighup"]
        wo = [r for r in raw["runs"] if r["scenario"] == "reload" and r["script"] == script and r["variant"] == "steady"]
        if not w or not wo:
            continue
        def med(rs, k):
            v = sorted(x[k] for x in rs if x[k] is not None)
            return v[len(v) // 2] if v else None
        tps = med(w, "tps") / med(wo, "tps") if med(wo, "tps") else None
        p99 = med(w, "p99_ms") / med(wo, "p99_ms") if med(wo, "p99_ms") else None
        md.append(f"| {script} | {tps:.3f} | {p99:.3f} | {max(x['max_ms'] for x in w)} / {max(x['max_ms'] for x in wo)} | "
                  f"{sum(x['sighups'] for x in w)} | {sum(x['errors'] for x in w + wo)} |")
    if meta.get("errors"):
        md += ["", "## Errors", ""] + [f"- {e[:500]}" for e in meta["errors"]]
    return "\n".join(md) + "\n"


def render(raw: dict, outdir: Path, charts_data: bool) -> str:
    """summary.md from the raw numbers alone (a run's end and --render); no charts-data.md section."""
    del charts_data
    if not raw["runs"]:
        return write_empty_summary(raw, outdir, "Restarts and reloads under pgbench", "run")
    md = summary(raw)
    (outdir / "summary.md").write_text(md)
    return md


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="6 s runs with a restart every 2 s, one reload pair of 2 s runs, 50,000 rows (≈ 1.3 min)")
    ap.add_argument("--out", type=Path, help="result folder (default results/<UTC ts>-restart[-quick])")
    ap.add_argument("--render", type=Path, help="only rebuild summary.md from this raw.json or raw.json.gz")
    args = ap.parse_args()
    if args.render:
        return rerender(args.render, render, False)
    preflight("restart.py", (PG_BIN / "postgres", PG_BIN / "pgbench", LOKADB_BIN))
    mode = Mode(args.quick)
    started, run_id, outdir = result_dir(args.out, "-restart", mode.quick)
    catch_signals()
    raise_fd_limit()
    ctx = Ctx(mode)
    meta = run_meta("restart.py", run_id, started, mode, lokadb_binary=binary_info(),
                    setup_commands=ctx.commands, errors=ctx.errors)
    # The command as the README gives it: the binaries' folder first.
    meta["command"] = (f"LOKADB_BENCH_TARGET={LOKADB_BIN.parent} .venv/bin/python research/bench/restart.py "
                       + shlex.join(sys.argv[1:])).strip()
    raw = {"meta": meta, "runs": []}

    def body():
        w = World(mode, ctx.commands)
        w.start_postgres()
        meta.update(w.create_roles_and_data())
        scripts = {}
        for name in ("read", "update"):
            p = w.tmp / f"{name}.sql"
            p.write_text(SCRIPTS[name].format(rows=mode.rows, orgs=ORGS))
            scripts[name] = p
        log("rolling restart with handover")
        for connect_each in (True, False):
            for script in ("read", "update"):
                # The same run without restarts first: what its latencies are compared with.
                for restart in (False, True):
                    raw["runs"].append(rolling(w, w.tmp, scripts, mode, connect_each, script, restart))
                    (outdir / "raw.json").write_text(json.dumps(raw, indent=1, default=str))
        log("reload")
        raw["runs"] += reload_runs(w, w.tmp, scripts, mode)
        return 1 if ctx.errors else 0

    return guarded_run(ctx, raw, outdir, render, False, body)


if __name__ == "__main__":
    sys.exit(main())
