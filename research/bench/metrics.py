#!/usr/bin/env python3
"""What `GET /metrics` costs: two proxies side by side over orgs.py's worlds, one with
`"metrics"` set and scraped once a second during every run (Prometheus scrapes every 15 s by
default: this is 15 times that), one without, and pgbench through each in turn, in
alternating order (statement_org.py's method).

    LOKADB_BENCH_TARGET=/work/main/target/release .venv/bin/python research/bench/metrics.py [--quick]

Reported per script, protocol and N, all from the same run: tps with ÷ tps without, the
proxy's and the cloud's CPU per statement with and without, and the scrapes made.

Writes raw.json.gz and summary.md into research/bench/results/<UTC ts>-metrics[-quick]/ (no
charts-data.md section); --render RAW writes summary.md again from a run's raw.json[.gz].
"""

import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lib.procs import free_port  # noqa: E402
from lib.side_by_side import arguments, side_by_side, summary  # noqa: E402  (statement_org.py's method)

METRICS_PORT = free_port()


def scrape_every_second(ctx):
    """Scrapes the proxy's /metrics once a second until the returned function is called."""
    done = threading.Event()
    taken = []

    def loop():
        while not done.wait(1.0):
            t0 = time.perf_counter()
            with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5) as r:
                r.read()
            taken.append(time.perf_counter() - t0)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()

    def stop():
        done.set()
        thread.join()
        return {"scrapes": len(taken), "scrape_ms_max": round(max(taken) * 1e3, 2) if taken else None}
    return stop


VARIANTS = {
    "scraped": {"top_extra": {"metrics": f"127.0.0.1:{METRICS_PORT}"}, "during": scrape_every_second},
    "off": {},
}


def render(raw: dict, outdir: Path, charts_data: bool) -> str:
    del charts_data  # a cost check, not a chart
    runs = [r for r in raw["runs"] if r["phase"] == "measure" and r.get("variant") == "scraped"]
    scrapes = sum(r.get("scrapes") or 0 for r in runs)
    slowest = max((r.get("scrape_ms_max") or 0 for r in runs), default=0)
    return summary(raw, outdir, "GET /metrics",
                   f"one with `\"metrics\"` set and scraped once a second during each of its "
                   f"runs ({scrapes} scrapes in all, the slowest {slowest} ms), one without")


def main() -> int:
    args, ap = arguments(__doc__, "N = 100 only, 1 s runs, R = 1 (≈ 35 s)")
    if not args.orgs and args.quick:
        args.orgs = "100"
    return side_by_side(args, ap, script="metrics.py", tag="-metrics", variants=VARIANTS,
                        render=render)


if __name__ == "__main__":
    sys.exit(main())
