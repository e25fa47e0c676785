"""What the benchmark scripts of research/bench/ share; each script (one per scenario) imports
from here, never from another script.

    binaries      where the binaries are: PG_BIN, LOKADB_BIN / AGENT_BIN / LINK_BIN
                  ($LOKADB_BENCH_TARGET), their sha256 at the start and the end of a run
    procs         children and their cleanup, signals, temporary folders, running commands,
                  /proc readings (CPU ticks and ns, RSS, load average)
    results       a run: its result folder, meta, guarded body, raw.json.gz, summary.md, --render,
                  the sections of charts-data.md
    charts        the charts' PNGs and the reference's and goal's marks
    numbers       percentile, median, the tables' number format
    pgbench       pgbench's output and per-transaction logs parsed
    clusters      a throwaway PostgreSQL cluster (PgCluster), the admin commands (`lokadb ...`),
                  the test schema and its load, the organizations' settings
    writers       writer threads on the cloud (moves.py, enable.py)
    relay         relay, agents, the latency link, certificates and tokens
    three_targets run.py's world: Postgres, the LokaDB proxy and PgBouncer side by side, pgbench
                  through each (headline.py, overload.py, restart.py)
    routing_world routing.py's world: organization 2 moved on fdw, the proxy, the profile
                  switch, the organization's statement log (clients, contention, django_app,
                  failures, migrations, paths)
    orgs_world    orgs.py's worlds of N organizations in one cloud, the proxy serving them,
                  pgbench through it
    side_by_side  two proxies side by side over orgs.py's worlds (statement_org.py, cloud_tls.py,
                  metrics.py)

Importing it checks that psycopg and matplotlib are there (and sets matplotlib's Agg backend).
"""

import sys

try:
    import psycopg
except ImportError:  # pragma: no cover
    sys.exit(
        "research/bench: psycopg 3 is missing. Run it with the repo venv "
        "(/work/main/.venv/bin/python, created by scripts/setup.sh) or\n"
        "  .venv/bin/pip install -r research/bench/requirements.txt"
    )
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:  # pragma: no cover
    sys.exit(
        "research/bench: matplotlib is missing (needed for the charts). Install it with\n"
        "  /work/main/.venv/bin/pip install -r research/bench/requirements.txt"
    )
del psycopg, plt  # checked, and the backend set: the modules and scripts import them themselves
