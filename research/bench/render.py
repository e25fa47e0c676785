#!/usr/bin/env python3
"""Draws the summaries and charts of benchmark runs again from their raw numbers, without running
anything (no cluster starts):

    .venv/bin/python research/bench/render.py [--charts-data] [RUN_FOLDER ...]

Without folders: every run folder research/bench/RESULTS.md links, oldest first. Each folder is
rendered by the script that made it (known by its name: `<UTC ts>-<scenario>[-quick]`, no scenario
for run.py), with that script's `--render`. With `--charts-data` the scripts also rewrite their
sections of charts-data.md (oldest first, so the newest run of a section has the last word);
without it, where a script can be told (`--no-charts-data`), charts-data.md is left alone. Scripts
without `--render` (their summary is written once, as the run ends) are listed and skipped.
Exit code 1 if a render failed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# A run folder's scenario (its name after the timestamp) → the script that made it; the first
# prefix that matches wins, so the longer names come first.
SCRIPTS = [
    ("statement-org-wire", "statement_org_wire.py"),
    ("statement-org", "statement_org.py"),
    ("cloud-tls", "cloud_tls.py"),
    ("moves", "moves.py"),
    ("orgs", "orgs.py"),
    ("routing", "routing.py"),
    ("tunnel", "tunnel.py"),
    ("headline", "headline.py"),
    ("overload", "overload.py"),
    ("clients", "clients.py"),
    ("contention", "contention.py"),
    ("django", "django_app.py"),
    ("paths", "paths.py"),
    ("failures", "failures.py"),
    ("enable", "enable.py"),
    ("migrations", "migrations.py"),
    ("metrics", "metrics.py"),
    ("restart", "restart.py"),
]
RUN_NAME = re.compile(r"^\d{8}T\d{4,6}Z(?:-(?P<tag>.+))?$")


def script_of(folder: Path) -> str | None:
    """The script that made the run in `folder`, from the folder's name (None: not a run's)."""
    m = RUN_NAME.match(folder.name)
    if not m:
        return None
    tag = m.group("tag") or ""
    for prefix, script in SCRIPTS:
        if tag.startswith(prefix):
            return script
    # run.py's folders are the timestamp alone, or with -quick.
    return "run.py" if tag in ("", "quick") else None


def cited_runs() -> list[Path]:
    """The run folders RESULTS.md links, oldest first."""
    text = (HERE / "RESULTS.md").read_text()
    names = sorted(set(re.findall(r"results/([^/)\s]+)/", text)))
    return [HERE / "results" / n for n in names]


def raw_of(folder: Path) -> Path | None:
    for name in ("raw.json.gz", "raw.json"):
        if (folder / name).exists():
            return folder / name
    return None


def options_of(script: str, cache: dict) -> str:
    """The script's --help text (which options it takes)."""
    if script not in cache:
        r = subprocess.run([sys.executable, str(HERE / script), "--help"], capture_output=True, text=True)
        cache[script] = r.stdout
    return cache[script]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="*", type=Path, help="run folders (default: every one RESULTS.md links)")
    ap.add_argument("--charts-data", action="store_true",
                    help="let the scripts rewrite their charts-data.md sections too")
    args = ap.parse_args()
    folders = sorted(args.folders, key=lambda f: f.name) if args.folders else cited_runs()
    helps: dict = {}
    failed, skipped, done = [], [], []
    for folder in folders:
        script, raw = script_of(folder), raw_of(folder)
        if not folder.is_dir() or script is None or raw is None:
            skipped.append(f"{folder.name}: not a run folder with its raw numbers")
            continue
        options = options_of(script, helps)
        if "--render" not in options:
            skipped.append(f"{folder.name}: {script} has no --render (its summary is written as the run ends)")
            continue
        cmd = [sys.executable, str(HERE / script), "--render", str(raw)]
        if not args.charts_data and "--no-charts-data" in options:
            cmd.append("--no-charts-data")
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            failed.append(folder.name)
            print(f"render.py: {folder.name} ({script}) failed:\n{r.stderr[-2000:]}", file=sys.stderr)
        else:
            done.append(f"{folder.name} ({script})")
    print(f"rendered {len(done)}:", *done, sep="\n  ")
    if skipped:
        print(f"skipped {len(skipped)}:", *skipped, sep="\n  ")
    if failed:
        print(f"failed {len(failed)}:", *failed, sep="\n  ")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
