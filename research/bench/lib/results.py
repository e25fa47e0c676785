"""A run and its outputs: the result folder, the meta of raw.json, the guarded body (cleanup
and the outputs whatever happened), raw.json.gz, summary.md, --render, and the sections of
charts-data.md."""

from __future__ import annotations

import datetime as dt
import gzip
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

import psycopg

from .binaries import REPO, binaries_at_end
from .procs import ignore_signals, log, safe_cleanup

HERE = Path(__file__).resolve().parent.parent  # research/bench: results/ and charts-data.md


class Ctx:
    """A run's state: its mode, the setup commands and errors that go into raw.json, and what the
    script adds."""

    def __init__(self, mode):
        self.mode = mode
        self.commands = []
        self.errors = []


def result_dir(out: Path | None, tag: str, quick: bool):
    """(start time, run id, result folder): `out`, else results/<UTC ts><tag>[-quick] (made)."""
    started = dt.datetime.now(dt.timezone.utc)
    run_id = started.strftime("%Y%m%dT%H%M%SZ") + tag + ("-quick" if quick else "")
    outdir = out or (HERE / "results" / run_id)
    outdir.mkdir(parents=True, exist_ok=True)
    return started, run_id, outdir


def run_meta(script: str, run_id: str, started, mode, **extra) -> dict:
    """The `meta` of a harness's raw.json: what ran, where, with which binaries' commit."""
    meta = {"run_id": run_id, "mode": mode.name, "started_utc": started.isoformat(),
            "command": (f"/work/main/.venv/bin/python research/bench/{script} " + shlex.join(sys.argv[1:])).strip(),
            "env": {"LOKADB_BENCH_TARGET": os.environ.get("LOKADB_BENCH_TARGET")},
            "mode_settings": dict(vars(mode)), "machine": machine_info(), "git": git_info()}
    meta.update(extra)
    return meta


def machine_info() -> dict:
    def sh(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, shell=True).stdout.strip()
        except Exception:
            return ""

    return {
        "nproc": os.cpu_count(),
        "nproc_cmd": sh("nproc"),
        "uname": sh("uname -a"),
        "kernel": platform.release(),
        "cpu_model": sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2").strip(),
        "mem_total": sh("grep MemTotal /proc/meminfo"),
        "loadavg_at_start": Path("/proc/loadavg").read_text().strip(),
        "os": sh(". /etc/os-release && echo $PRETTY_NAME"),
        "python": sys.version.split()[0],
        "psycopg": psycopg.__version__,
    }


def git_info() -> dict:
    def g(*a):
        r = subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True)
        return r.stdout.strip()

    st = g("status", "--porcelain")
    return {"commit": g("rev-parse", "HEAD"), "dirty": bool(st), "status_porcelain": st.splitlines()[:50]}


def parse_rtts(text: str, example: str) -> list[float]:
    """--rtts: round-trip times in ms separated by commas; exits with a message naming the
    problem (the example shows the form)."""
    try:
        rtts = [float(x) for x in text.split(",")]
    except ValueError:
        sys.exit(f"--rtts {text!r}: write round-trip times in ms separated by commas, e.g. {example}")
    if any(r < 0 for r in rtts):
        sys.exit(f"--rtts {text!r}: a round-trip time cannot be negative")
    return rtts


def run_rounds(ctx, raw: dict, outdir: Path, rtt_round) -> int:
    """One rtt_round(ctx, rtt) per RTT of ctx.mode, each appended to raw["rounds"] and saved
    in raw.json as it ends; 1 when a round had errors, else 0."""
    rc = 0
    for rtt in ctx.mode.rtts_ms:
        r = rtt_round(ctx, float(rtt))
        raw["rounds"].append(r)
        (outdir / "raw.json").write_text(json.dumps(raw, indent=1, default=str))
        if r["errors"]:
            rc = 1
    return rc


# --------------------------------------------------------------------------------------
# The guarded run


def guarded_run(ctx, raw: dict, outdir: Path, render, charts_data, body, binaries=(),
                before_cleanup=None, on_error=None) -> int:
    """A harness's run: body() (its exit code; None is 0) with an interrupt (130) or an
    exception (1, recorded in ctx.errors, then on_error(): what the script keeps of a failure)
    caught; then, whatever happened, signals ignored, before_cleanup() (what the script stops
    in its own order), every child and cluster stopped, `binaries` checked unchanged since
    raw["meta"]["binaries"] was taken (binaries.binaries_at_end) and the outputs written
    (finish_run; charts_data a bool, or a function of the exit code). Returns the exit
    code."""
    t_start = time.time()
    rc = 0
    try:
        rc = body() or 0
    except KeyboardInterrupt as e:
        ctx.errors.append(f"interrupted: {e}")
        rc = 130
    except Exception as e:  # noqa: BLE001
        rc = fatal(ctx.errors, e)
        if on_error is not None:
            on_error()
    finally:
        ignore_signals()
        if before_cleanup is not None:
            before_cleanup()
        safe_cleanup()
        if binaries:
            binaries_at_end(raw["meta"], ctx.errors, binaries)
        finish_run(raw, outdir, t_start, render, charts_data(rc) if callable(charts_data) else charts_data)
    return rc


def finish_run(raw: dict, outdir: Path, t_start: float, render, charts_data: bool) -> None:
    """The end of a run: its wall time and load average in raw["meta"], then the rendered
    outputs and raw.json (save_rendered)."""
    meta = raw["meta"]
    meta["wall_seconds"] = round(time.time() - t_start, 1)
    meta["loadavg_at_end"] = Path("/proc/loadavg").read_text().strip()
    save_rendered(raw, outdir / "raw.json", render, charts_data)
    log(f"results in {outdir}")


def fatal(errors: list, e: Exception) -> int:
    """Records an exception that ended a run (in its except clause); returns the exit code."""
    errors.append(f"fatal: {e!r}\n{traceback.format_exc()}")
    log(f"FAILED: {e!r}")
    traceback.print_exc()
    return 1


# --------------------------------------------------------------------------------------
# Outputs


def write_raw_gz(outdir: Path, raw: dict) -> Path:
    """raw.json.gz in outdir (and no raw.json): a run's samples compressed, so that a run folder
    stays small in git."""
    path = outdir / "raw.json.gz"
    # No timestamp in the gzip header: a run rendered again from the same numbers writes the
    # same bytes, so git sees no change.
    data = json.dumps(raw, indent=1, default=str).encode()
    path.write_bytes(gzip.compress(data, mtime=0))
    (outdir / "raw.json").unlink(missing_ok=True)
    return path


def read_raw(path: Path) -> dict:
    """A run's raw.json or raw.json.gz."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def save_rendered(raw: dict, raw_json: Path, render, charts_data: bool) -> None:
    """render(raw, outdir, charts_data) into raw_json's folder, then the raw numbers (with the
    summary) compressed beside it as raw.json.gz (write_raw_gz); prints the markdown."""
    md = render(raw, raw_json.parent, charts_data)
    write_raw_gz(raw_json.parent, raw)
    print(md)


def rerender(raw_json: Path, render, charts_data: bool) -> int:
    """--render: render again from a run's raw.json or raw.json.gz, written back compressed
    (save_rendered)."""
    save_rendered(read_raw(raw_json), raw_json, render, charts_data)
    return 0


def write_outputs(raw: dict, s: dict, outdir: Path, charts_data: bool, summary_markdown, draw_charts,
                  update_charts_data) -> str:
    """summary.md, the charts (one that fails is reported, not fatal) and, if charts_data, the
    charts-data.md section of a run summarized as s, by the script's own functions; returns the
    markdown."""
    md = summary_markdown(raw, s)
    (outdir / "summary.md").write_text(md)
    charts = []
    try:
        charts = draw_charts(outdir, raw, s)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    if charts_data:
        update_charts_data(raw, s, outdir, charts)
    return md


def write_summary(outdir: Path, md: str, errors: list) -> str:
    """summary.md: `md`, then the run's errors if any; returns it."""
    if errors:
        md += "\n## Errors\n\n" + "\n".join(f"- {e[:500]}" for e in errors) + "\n"
    (outdir / "summary.md").write_text(md)
    return md


def write_empty_summary(raw: dict, outdir: Path, title: str, what: str) -> str:
    """summary.md of a run in which no `what` completed: its title and errors; returns it."""
    md = f"# {title} — run {raw['meta']['run_id']}\n\nNo {what} completed.\n\n" + "\n".join(
        f"- {e[:2000]}" for e in raw["meta"]["errors"]) + "\n"
    (outdir / "summary.md").write_text(md)
    return md


def write_with_chart(raw: dict, outdir: Path, md: str, draw, alt: str, section: str,
                     charts_data: bool = True) -> str:
    """summary.md: md, then the chart draw(raw, outdir) made (its file name, or None; one that
    fails is reported, not fatal); with charts_data, a full run without errors is also
    charts-data.md's section `section`, the chart linked from there. Returns the markdown."""
    try:
        chart = draw(raw, outdir)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        chart = None
    if chart:
        md += f"\n![{alt}]({chart})\n"
    (outdir / "summary.md").write_text(md)
    if charts_data and raw["meta"]["mode"] == "full" and not raw["meta"]["errors"]:
        summary_to_charts_data(
            section, md.replace(f"]({chart})", f"](results/{raw['meta']['run_id']}/{chart})") if chart else md)
    return md


# --------------------------------------------------------------------------------------
# charts-data.md


def summary_to_charts_data(name: str, summary_md: str) -> None:
    """A harness's summary.md as its charts-data.md section (its title one level down)."""
    write_charts_section(name, re.sub(r"^# ", "## ", summary_md, count=1))


def write_charts_section(name: str, section: str, path: Path | None = None) -> None:
    """Replaces what stands between `<!-- BEGIN name -->` and `<!-- END name -->` in
    research/bench/charts-data.md (or path) with section, or appends it if it is not there yet
    (every script's section goes through here)."""
    path = path or HERE / "charts-data.md"
    begin = f"<!-- BEGIN {name} -->"
    end = f"<!-- END {name} -->"
    block = f"{begin}\n{section}\n{end}\n"
    if path.exists():
        text = path.read_text()
    else:
        text = (
            "# Numbers behind the benchmark charts\n\n"
            "Written by `research/bench/run.py`: each section is replaced by the latest run of its "
            "mode; the charts are PNGs in the run's result folder, the raw numbers in its `raw.json`.\n\n"
        )
    if begin in text and end in text:
        pre, rest = text.split(begin, 1)
        _, post = rest.split(end, 1)
        # One blank line before the next section, as an appended section gets.
        post = post.lstrip("\n")
        text = pre + block + ("\n" + post if post else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)
