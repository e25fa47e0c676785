#!/usr/bin/env python3
"""What `lokadb.statement_org` costs: two proxies side by side over orgs.py's worlds, one with
it (the default) and one with `"statement_org": false`, and pgbench through each in turn,
in alternating order.

    LOKADB_BENCH_TARGET=/work/target/release .venv/bin/python research/bench/statement_org.py [--quick]

Each pgbench transaction picks a random organization, so at N = 1000 nearly every statement
tells the cloud a new organization (the worst case: a small statement of the proxy's ahead of
it in the cloud); at N = 1 the cloud is told once per session. Reported per script, protocol
and N, all from the same run: tps with ÷ tps without, and the proxy's and the cloud's CPU
per statement with and without.

Writes raw.json and summary.md into research/bench/results/<UTC ts>-statement-org[-quick]/.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lib.side_by_side import arguments, side_by_side, summary  # noqa: E402  (the side-by-side method)

VARIANTS = {"on": {"db_extra": None}, "off": {"db_extra": {"statement_org": False}}}


def render(raw: dict, outdir: Path, charts_data: bool) -> str:
    del charts_data  # no charts-data.md section: a cost check, not a chart
    layout = ("a partition each" if raw["meta"]["mode_settings"].get("layout", "partitioned") == "partitioned"
              else "back in DEFAULT")
    return summary(raw, outdir, "statement_org benchmark",
                   f"organizations {layout}, one with `lokadb.statement_org` (the default), one with "
                   f"`\"statement_org\": false`")


def main() -> int:
    args, ap = arguments(__doc__, "N = 1000 only, 1 s runs, R = 1 (≈ 30 s)")
    return side_by_side(args, ap, script="statement_org.py", tag="-statement-org", variants=VARIANTS,
                        render=render)


if __name__ == "__main__":
    sys.exit(main())
