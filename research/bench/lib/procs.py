"""Processes and the machine: the children every script starts and their cleanup (also on a
signal), temporary folders, commands run and checked, /proc readings."""

from __future__ import annotations

import os
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PG_USER = "lokadb-pg"


# --------------------------------------------------------------------------------------
# Process bookkeeping and cleanup


CHILDREN: list[subprocess.Popen] = []


TEMP_DIRS: list[Path] = []


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(p: subprocess.Popen, sig=signal.SIGTERM, wait=10.0) -> None:
    if p.poll() is not None:
        return
    try:
        p.send_signal(sig)
        p.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        p.kill()
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    except ProcessLookupError:
        pass


def cleanup() -> None:
    # Reverse start order: proxies first, Postgres last.
    for p in reversed(CHILDREN):
        sig = getattr(p, "_bench_stop_signal", signal.SIGTERM)
        stop_process(p, sig)
    CHILDREN.clear()
    for d in TEMP_DIRS:
        shutil.rmtree(d, ignore_errors=True)
    TEMP_DIRS.clear()


def on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def catch_signals() -> None:
    """Ctrl-C, kill and hang-up all end in the cleanup (SIGINT explicitly: a shell starting us in
    the background would otherwise have it ignored)."""
    for sig in SIGNALS:
        signal.signal(sig, on_sigterm)


def ignore_signals() -> None:
    """A second Ctrl-C must not stop the cleanup."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def safe_cleanup() -> None:
    """cleanup(), a problem logged rather than raised (it runs in a finally)."""
    try:
        cleanup()
    except Exception as e:  # pragma: no cover
        log(f"cleanup problem: {e}")


def raise_fd_limit() -> None:
    """Open files: the soft limit up to max(hard, 65536), else to the hard limit (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(hard, 65536)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def preflight(script: str, paths, hint: str = "run scripts/setup.sh and the cargo build in the README first") -> None:
    """Exits with a message unless run as root (Postgres runs as the user lokadb-pg) and every
    path in `paths` exists."""
    if os.geteuid() != 0:
        sys.exit(f"{script} must run as root (it starts Postgres as the user lokadb-pg)")
    for p in paths:
        if not Path(p).exists():
            sys.exit(f"missing {p}: {hint}")


def temp_dir(prefix: str) -> Path:
    """A temporary folder that cleanup() removes, readable by all (the Postgres user's clusters)."""
    d = Path(tempfile.mkdtemp(prefix=prefix))
    TEMP_DIRS.append(d)
    os.chmod(d, 0o755)
    return d


def run_captured(cmd, timeout: float, **kw):
    """Runs cmd in a session of its own (stopped by cleanup() while it runs), its output captured,
    killed after timeout s. Returns (stdout, stderr, returncode, timed_out)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, **kw)
    CHILDREN.append(p)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        p.kill()
        stdout, stderr = p.communicate()
        timed_out = True
    finally:
        CHILDREN.remove(p)
    return stdout, stderr, p.returncode, timed_out


def run_checked(cmd, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise RuntimeError(
            f"command failed ({r.returncode}): {shlex.join(map(str, cmd))}\n{r.stdout}\n{r.stderr}"
        )
    return r


# --------------------------------------------------------------------------------------
# /proc readings


CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int):
    """utime + stime of a whole process (all threads), in clock ticks; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    fields = data[data.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state); utime is field 14, stime field 15.
    return int(fields[11]) + int(fields[12])


def sched_ns(pid: int):
    """CPU time of a process in ns (all its threads' schedstat), finer than the 10 ms ticks; None if
    it is gone."""
    total, seen = 0, False
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return None
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
                seen = True
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            pass
    return total if seen else None


def delta(a, b):
    """b - a of two readings, None if either is (a process gone)."""
    return (b - a) if a is not None and b is not None else None


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except FileNotFoundError:
        pass
    return -1


def proc_status(pid: int) -> dict:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "VmHWM", "RssAnon", "Threads"):
                    out[k] = int(v.split()[0])
    except FileNotFoundError:
        pass
    return out


def ticks_to_ms(t):
    return t * 1000.0 / CLK_TCK


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def stat_fields(pid: int):
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return data[data.rindex(")") + 2:].split()


def tree_ticks(pid: int):
    """CPU ticks of a Postgres cluster: the postmaster, its reaped children (cutime+cstime) and
    its live children. A backend that ends between two readings is counted by cutime."""
    f = stat_fields(pid)
    if f is None:
        return None
    total = sum(int(x) for x in f[11:15])
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        cf = stat_fields(int(d))
        if cf and cf[1] == str(pid):
            total += int(cf[11]) + int(cf[12])
    return total
