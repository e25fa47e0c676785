"""The tunnel's processes: the relay, agents, the latency link in front of a port, their
certificates and tokens, and a run's one tunnel (prepare_tunnel, start_tunnel, stop_tunnel)."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import secrets
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path

import psycopg

from .binaries import AGENT_BIN, LINK_BIN, LOKADB_BIN
from .procs import CHILDREN, free_port, run_checked, stop_process


def make_certs(d: Path, commands: list) -> dict:
    """A CA and a relay certificate for 127.0.0.1/localhost it signed (openssl, EC P-256)."""
    ca_key, ca, key, csr, crt = (d / n for n in ("ca.key", "ca.crt", "relay.key", "relay.csr", "relay.crt"))
    ext = d / "ext.cnf"
    ext.write_text("basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n"
                   "extendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n")
    cmds = [
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=LokaDB bench CA",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign"],
        ["openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", key, "-out", csr, "-subj", "/CN=localhost"],
        ["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", crt, "-days", "2", "-extfile", ext],
    ]
    for c in cmds:
        commands.append(shlex.join(map(str, c)))
        run_checked([str(x) for x in c])
    return {"ca": str(ca), "cert": str(crt), "key": str(key)}


def new_token(org: str):
    token = f"{org}.{secrets.token_hex(16)}"
    return token, "sha256:" + hashlib.sha256(token.encode()).hexdigest()


class LineProc:
    """A child whose stdout lines are pumped into a queue (to wait for a listening line)."""

    def __init__(self, cmd, env, stderr_path: Path, commands: list, label: str):
        commands.append(f"{label}: {shlex.join(map(str, cmd))}")
        self.proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE,
                                     stderr=open(stderr_path, "ab"), stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True, text=True)
        self.stderr_path = stderr_path
        CHILDREN.append(self.proc)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put((time.monotonic(), line))
        self.lines.put((time.monotonic(), None))

    def wait_line(self, pattern: str, timeout=30.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                t, line = self.lines.get(timeout=max(0.05, deadline - time.monotonic()))
            except queue.Empty:
                line, t = None, None
            if line is None:
                raise RuntimeError(f"no line matching {pattern!r}; stderr:\n"
                                   + self.stderr_path.read_text(errors="replace")[-3000:])
            m = re.search(pattern, line)
            if m:
                return t, m

    def stop(self, sig=signal.SIGTERM):
        stop_process(self.proc, sig)
        if self.proc in CHILDREN:
            CHILDREN.remove(self.proc)


class Relay(LineProc):
    def __init__(self, tmp: Path, certs: dict, tokens: dict, env_extra: dict, commands: list,
                 agents_port=0, postgres_port=0, extra_cfg=None, tag="relay"):
        cfg = {"relay": {"agents": f"127.0.0.1:{agents_port}",
                         "postgres": f"127.0.0.1:{postgres_port}",
                         "tls": {"cert": certs["cert"], "key": certs["key"]},
                         "tokens": tokens, **(extra_cfg or {})}}
        path = tmp / f"{tag}.json"
        path.write_text(json.dumps(cfg, indent=1))
        env = dict(os.environ)
        for k in [k for k in env if k.startswith("LOKADB_")]:
            del env[k]
        env.update({"LOKADB_LOG": "warn", **env_extra})
        self.env_extra = env_extra
        super().__init__([LOKADB_BIN, "relay", "--config", path], env, tmp / f"{tag}.stderr.log",
                         commands, " ".join(f"{k}={v}" for k, v in env_extra.items()) or "relay")
        self.t_listening, m = self.wait_line(r"lokadb relay listening on (\S+):(\d+) \(agents\) and (\S+):(\d+) \(postgres\)")
        self.agents_port = int(m.group(2))
        self.pg_port = int(m.group(4))
        self.pid = self.proc.pid

    def stats(self) -> dict:
        with psycopg.connect(host="127.0.0.1", port=self.pg_port, user="bench", dbname="lokadb_relay",
                             sslmode="disable", autocommit=True, connect_timeout=5) as c:
            rows = c.execute("SHOW STATS").fetchall()
        return {k: int(v) for k, v in rows}

    def connected(self) -> int:
        try:
            return self.stats()["organizations_connected"]
        except (psycopg.Error, KeyError, OSError):
            return -1

    def wait_connected(self, n: int, timeout=60.0, poll=0.01) -> float:
        t0 = time.monotonic()
        while True:
            if self.connected() >= n:
                return time.monotonic()
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"only {self.connected()} of {n} agents connected after {timeout} s")
            if self.proc.poll() is not None:
                raise RuntimeError("relay died:\n" + self.stderr_path.read_text(errors="replace")[-3000:])
            time.sleep(poll)


def start_agent(relay_addr: str, token: str, pg_addr: str, ca: str, env_extra: dict, logf,
                max_conns=100):
    env = {"PATH": "/usr/bin:/bin", "LOKADB_LOG": "warn", **env_extra}
    p = subprocess.Popen([str(AGENT_BIN), "--relay", relay_addr, "--token", token,
                          "--postgres", pg_addr, "--ca", ca, "--max-conns", str(max_conns)],
                         stdout=subprocess.DEVNULL, stderr=logf, stdin=subprocess.DEVNULL,
                         env=env, start_new_session=True)
    CHILDREN.append(p)
    return p


def start_link(target_port: int, delay_ms: float, tmp: Path, commands: list) -> LineProc:
    lp = LineProc([LINK_BIN, "--listen", "127.0.0.1:0", "--target", f"127.0.0.1:{target_port}",
                   "--delay-ms", str(delay_ms)], dict(os.environ), tmp / "link.stderr.log", commands,
                  "latency-link")
    _, m = lp.wait_line(r"listening on (\S+):(\d+)")
    lp.port = int(m.group(2))
    return lp


def stop_agents(agents):
    for p in agents:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in agents:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p in CHILDREN:
            CHILDREN.remove(p)


def prepare_tunnel(ctx, org: str) -> None:
    """What the relays and agents of a run with one organization share, on ctx: certificates,
    `org`'s agent token, fixed relay ports (a relay started again is at the same addresses) and
    the agents' log."""
    ctx.certs = make_certs(ctx.tmp, ctx.commands)
    ctx.token, ctx.token_hash = new_token(org)
    ctx.relay_agents_port, ctx.relay_pg_port = free_port(), free_port()
    ctx.agent_log = open(ctx.tmp / "agent.stderr.log", "ab")


def tunnel_relay(ctx, org: str, tag: str) -> Relay:
    """A relay on ctx's fixed ports that knows `org`'s token (prepare_tunnel)."""
    return Relay(ctx.tmp, ctx.certs, {org: ctx.token_hash}, {}, ctx.commands,
                 agents_port=ctx.relay_agents_port, postgres_port=ctx.relay_pg_port, tag=tag)


def tunnel_agent(ctx, port: int, pg_addr: str):
    """An agent with ctx's token (prepare_tunnel) for the Postgres at pg_addr, dialing 127.0.0.1:port
    (a relay's agent port, or a latency link in front of it)."""
    return start_agent(f"127.0.0.1:{port}", ctx.token, pg_addr, ctx.certs["ca"], {}, ctx.agent_log)


def start_tunnel(ctx, org: str, tag: str, rtt_ms: float) -> None:
    """ctx.relay (tunnel_relay), ctx.link (a latency link, rtt_ms / 2 each way, in front of the
    relay's agent port) and ctx.agent (tunnel_agent, for ctx.org's cluster), set one by one so that
    a caller's finally stops what started; then waits until the agent is connected."""
    ctx.relay = tunnel_relay(ctx, org, tag)
    ctx.link = start_link(ctx.relay.agents_port, rtt_ms / 2, ctx.tmp, ctx.commands)
    ctx.agent = tunnel_agent(ctx, ctx.link.port, ctx.org.addr())
    ctx.relay.wait_connected(1, timeout=60)


def stop_tunnel(ctx, rec: dict | None = None) -> None:
    """Stops what start_tunnel started and ctx.proxy, whichever of them runs; with rec, keeps the
    proxy's and the relay's stderr tails in it."""
    if getattr(ctx, "proxy", None) is not None:
        ctx.proxy.stop()
        if rec is not None:
            rec["proxy_stderr_tail"] = ctx.proxy.stderr_path.read_text(errors="replace")[-3000:]
    if getattr(ctx, "agent", None) is not None:
        stop_agents([ctx.agent])
    if getattr(ctx, "link", None) is not None:
        ctx.link.stop()
    if getattr(ctx, "relay", None) is not None:
        ctx.relay.stop()
        if rec is not None:
            rec["relay_stderr_tail"] = ctx.relay.stderr_path.read_text(errors="replace")[-1500:]
