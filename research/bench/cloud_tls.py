#!/usr/bin/env python3
"""What TLS to the cloud costs: two proxies side by side over orgs.py's worlds, one with
`sslmode=require` in each `cloud` string, one with `sslmode=disable`, and pgbench through
each in turn, in alternating order (statement_org.py's method).

    LOKADB_BENCH_TARGET=/work/main/target/release .venv/bin/python research/bench/cloud_tls.py [--quick]

The cloud needs a Postgres built with TLS: Debian's postgresql-15 by default
(LOKADB_BENCH_PG_BIN=/usr/lib/postgresql/15/bin; the PostgreSQL 18 wheel has none). Its
certificate is a throwaway self-signed one made with openssl; `require` encrypts without
checking it (verify-full costs the same per statement: the check is at connect). Clients
reach the proxies in plain TCP, so the difference is the proxy → cloud leg only: the proxy
encrypts and decrypts every message, and so does the cloud backend. Reported per script,
protocol and N, all from the same run: tps with TLS ÷ tps plain, and the proxy's and the
cloud's CPU per statement with and without.

Writes raw.json.gz and summary.md into research/bench/results/<UTC ts>-cloud-tls[-quick]/ (no
charts-data.md section); --render RAW writes summary.md again from a run's raw.json[.gz].
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("LOKADB_BENCH_PG_BIN", "/usr/lib/postgresql/15/bin")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lib.binaries import PG_BIN  # noqa: E402  (after LOKADB_BENCH_PG_BIN's default is set)
from lib.procs import PG_USER  # noqa: E402
from lib.side_by_side import arguments, side_by_side, summary  # noqa: E402  (statement_org.py's method)

VARIANTS = {"tls": {"cloud_options": "sslmode=require"}, "plain": {"cloud_options": "sslmode=disable"}}


def enable_tls(ctx) -> None:
    """A self-signed certificate in the cloud's data folder, and ssl = on (a reload)."""
    cert, key = ctx.cloud.data / "server.crt", ctx.cloud.data / "server.key"
    cmd = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
           "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)]
    ctx.commands.append(" ".join(cmd))
    subprocess.run(cmd, check=True, capture_output=True)
    for f in (cert, key):
        shutil.chown(f, PG_USER, PG_USER)
        os.chmod(f, 0o600)
    with ctx.cloud.conn() as c:
        if not c.execute("SHOW ssl_library").fetchone()[0]:
            raise RuntimeError(f"the Postgres in {PG_BIN} has no TLS: set LOKADB_BENCH_PG_BIN "
                               "to a build with it (apt-get install postgresql-15)")
        c.execute("ALTER SYSTEM SET ssl = on")
        c.execute("SELECT pg_reload_conf()")
    ctx.commands.append("(cloud) ALTER SYSTEM SET ssl = on; SELECT pg_reload_conf()")


def render(raw: dict, outdir: Path, charts_data: bool) -> str:
    del charts_data  # a cost check, not a chart
    return summary(raw, outdir, "TLS to the cloud",
                   "one with `sslmode=require` in each `cloud` string (TLS 1.3, the cloud's "
                   "OpenSSL and the proxy's rustls), one with `sslmode=disable`; clients reach "
                   "both in plain TCP")


def main() -> int:
    args, ap = arguments(__doc__, "N = 100 only, 1 s runs, R = 1 (≈ 35 s)")
    if not args.orgs and args.quick:
        args.orgs = "100"
    return side_by_side(args, ap, script="cloud_tls.py", tag="-cloud-tls", variants=VARIANTS,
                        render=render, prepare_cloud=enable_tls)


if __name__ == "__main__":
    sys.exit(main())
