"""Where the binaries are, and what they were: Postgres's (PG_BIN), LokaDB's in
$LOKADB_BENCH_TARGET (default /work/target-bench/release; run.py's world, three_targets, has its
own default: target/release), their sha256 and mtime at the start and the end of a run."""

from __future__ import annotations

import datetime as dt
import hashlib
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # research/bench
REPO = HERE.parent.parent

# LOKADB_BENCH_PG_BIN: another build (cloud_tls.py needs one with TLS: Debian's postgresql-15).
PG_BIN = Path(os.environ.get("LOKADB_BENCH_PG_BIN", REPO / ".pg" / "bin"))

BIN_DIR = Path(os.environ.get("LOKADB_BENCH_TARGET", "/work/target-bench/release"))
LOKADB_BIN = BIN_DIR / "lokadb"
AGENT_BIN = BIN_DIR / "lokadb-agent"
LINK_BIN = BIN_DIR / "latency-link"


def binary_info(p: Path) -> dict:
    h = hashlib.sha256(p.read_bytes()).hexdigest()
    st = p.stat()
    return {"path": str(p), "sha256": h, "size": st.st_size,
            "mtime_utc": dt.datetime.fromtimestamp(st.st_mtime, dt.timezone.utc).isoformat()}


def binaries_at_end(meta: dict, errors: list, bins) -> None:
    """The binaries' sha256 at the end of a run (meta["binaries_at_end"]); an error if one differs
    from meta["binaries"] (they may be rebuilt while the benchmark runs)."""
    try:
        meta["binaries_at_end"] = {b.name: binary_info(b)["sha256"] for b in bins}
        changed = [b for b, h in meta["binaries_at_end"].items() if h != meta["binaries"][b]["sha256"]]
        if changed:
            errors.append(f"binaries changed during the run: {', '.join(changed)} (sha256 at the end differs)")
    except OSError as e:
        errors.append(f"binaries at the end: {e!r}")


def bin_dir_of(meta: dict, default) -> str:
    """Where a run's binaries were, as its raw numbers recorded them (the folder of its lokadb
    binary), not where they are as the summary is rendered again."""
    for b in (meta.get("binaries") or {}).values():
        if isinstance(b, dict) and b.get("path"):
            return str(Path(b["path"]).parent)
    return str(default)
