#!/usr/bin/env bash
# Builds lokadb-agent as one static executable (no shared libraries: `ldd` says "not a
# dynamic executable"), stripped, and checks it: static, at most 8 MiB.
#
# Debian 12 has no musl Rust target installed by default, so this links glibc
# statically (crt-static, non-PIE). `--target` keeps the static flags off build
# scripts and proc macros. glibc's linker warns that getaddrinfo in a static binary
# needs the shared NSS libraries of the same glibc version at run time: only relay or
# Postgres *host names* go through it; IP addresses are used without DNS.
#
#   bash scripts/build-agent-static.sh            # -> target/static/.../lokadb-agent
#   LOKADB_STATIC_TARGET_DIR=/tmp/t bash scripts/build-agent-static.sh
#
# Prints the binary's path on the last line.
set -euo pipefail
cd "$(dirname "$0")/.."

target_dir="${LOKADB_STATIC_TARGET_DIR:-target/static}"
triple="x86_64-unknown-linux-gnu"
max_bytes=$((8 * 1024 * 1024))

RUSTFLAGS="-C target-feature=+crt-static -C relocation-model=static" \
    cargo build --release -p lokadb-agent --target "$triple" --target-dir "$target_dir" \
    --config profile.release.debug=0 --config profile.release.strip=true >&2

bin="$target_dir/$triple/release/lokadb-agent"
ldd_out=$(ldd "$bin" 2>&1 || true) # ldd exits 1 on a static executable
if [[ "$ldd_out" != *"not a dynamic executable"* ]]; then
    echo "build-agent-static: $bin is not static; ldd says:" >&2
    echo "$ldd_out" >&2
    exit 1
fi
size=$(stat -c %s "$bin")
if [ "$size" -gt "$max_bytes" ]; then
    echo "build-agent-static: $bin is $size bytes, over the $max_bytes limit" >&2
    exit 1
fi
echo "build-agent-static: static, $size bytes ($((size / 1024)) KiB)" >&2
echo "$bin"
