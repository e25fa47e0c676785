#!/usr/bin/env bash
# Everything CI checks, in order: setup, release build, the workspace's tests against
# PostgreSQL 18 (<repo>/.pg/bin), the static agent build, then the integration tests again
# against Debian's PostgreSQL 15 with the static agent.
# Run as root on Debian 12 (setup installs packages). Honors CARGO_TARGET_DIR.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
if ! command -v cargo >/dev/null 2>&1 && [[ -x "$HOME/.cargo/bin/cargo" ]]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

step() { printf '\n==> %s\n' "$*"; }

step "setup"
bash "$REPO/scripts/setup.sh" </dev/null

TARGET_DIR="${CARGO_TARGET_DIR:-$REPO/target}"
export LOKADB_BIN="$TARGET_DIR/release/lokadb"
unset LOKADB_PG_BIN

step "cargo build --release --workspace --all-targets"
cargo build --release --workspace --all-targets

step "cargo test --release --workspace (PostgreSQL 18: $("$REPO/.pg/bin/postgres" --version))"
cargo test --release --workspace --no-fail-fast

step "static lokadb-agent (ldd: not a dynamic executable; at most 8 MiB)"
STATIC_AGENT="$(LOKADB_STATIC_TARGET_DIR="$TARGET_DIR/static" bash "$REPO/scripts/build-agent-static.sh" | tail -n 1)"

PG15_BIN=/usr/lib/postgresql/15/bin
step "integration tests again (PostgreSQL 15: $("$PG15_BIN/postgres" --version); the static agent)"
# --workspace keeps the feature set of the run above, so nothing is rebuilt.
LOKADB_PG_BIN="$PG15_BIN" LOKADB_AGENT_BIN="$STATIC_AGENT" \
    cargo test --release --workspace --test it --no-fail-fast

step "all passed"
