"""pgbench's output and its per-transaction logs (-l), parsed."""

from __future__ import annotations

import glob
import re
from pathlib import Path

from .numbers import percentile


# What parse_pgbench reads from pgbench's report: key, pattern (its first group), type.
PGBENCH_FIGURES = [
    ("tps", r"^tps = ([\d.]+)", float),
    ("transactions", r"number of transactions actually processed: (\d+)", int),
    ("failed_transactions", r"number of failed transactions: (\d+)", int),
    ("latency_avg_ms", r"latency average = ([\d.]+) ms", float),
    ("avg_connection_ms", r"average connection time = ([\d.]+) ms", float),
    # With -R and -L (an open model): transactions never started because they were already
    # later than the limit, and those that finished over it.
    ("skipped_transactions", r"number of transactions skipped: (\d+)", int),
    ("late_transactions", r"number of transactions above the [\d.]+ ms latency limit: (\d+)/(\d+)", int),
]


def parse_pgbench(stdout: str) -> dict:
    """pgbench's report as numbers (None for what it did not print)."""
    out = {}
    for key, pattern, kind in PGBENCH_FIGURES:
        m = re.search(pattern, stdout, re.M)
        out[key] = kind(m.group(1)) if m else None
    return out


def pgbench_errors(rec: dict, stdout: str, stderr: str, rc, timed_out: bool, timeout, more=(),
                   stdout_lines=25) -> list[str]:
    """What went wrong in a pgbench run (timeout, exit code, no or failed transactions, then `more`),
    recorded in rec with the tails of its output; [] if nothing did."""
    errors = []
    if timed_out:
        errors.append(f"pgbench timed out after {timeout}s and was killed")
    if rc != 0:
        errors.append(f"pgbench exit code {rc}")
    if not (rec.get("transactions") or 0):
        errors.append("no transactions processed")
    if rec.get("failed_transactions"):
        errors.append(f"{rec['failed_transactions']} failed transactions")
    errors += more
    if errors:
        rec["error"] = "; ".join(errors)
        lines = stderr.strip().splitlines()
        rec["stderr_tail"] = "\n".join(lines[-15:])
        first = next((l for l in lines if "ERROR" in l or "FATAL" in l), lines[-1] if lines else "")
        rec["first_error"] = first.strip()
        rec["stdout_tail"] = "\n".join(stdout.strip().splitlines()[-stdout_lines:])
    return errors


def txn_entries(prefix: Path) -> tuple[list[int], list[float], int]:
    """pgbench's per-transaction logs (-l) under prefix.*: the latencies (µs), the completion
    times (s, epoch) and the number of failed or skipped transactions."""
    lat, done, failed = [], [], 0
    for f in glob.glob(f"{prefix}.*"):
        with open(f) as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                try:
                    lat.append(int(parts[2]))
                except ValueError:  # "failed" / "skipped"
                    failed += 1
                    continue
                if len(parts) >= 6:
                    done.append(int(parts[4]) + int(parts[5]) / 1e6)
    return lat, done, failed


def read_txn_logs(prefix: Path) -> dict:
    """p50 and p99 of pgbench's per-transaction logs under prefix.*, with their counts."""
    lat, _, failed = txn_entries(prefix)
    return latency_summary(lat, failed)


def latency_summary(lat: list[int], failed: int) -> dict:
    """p50 and p99 (ms) of latencies in µs, with the counts."""
    lat = sorted(lat)
    return {
        "logged_transactions": len(lat),
        "logged_failed": failed,
        "p50_ms": round(percentile(lat, 0.50) / 1000, 4) if lat else None,
        "p99_ms": round(percentile(lat, 0.99) / 1000, 4) if lat else None,
    }
