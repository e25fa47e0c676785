#!/bin/bash
# Every benchmark, one after the other: research/bench/all.sh [--quick | --render]
# (full ≈ 2 h on 2 cores; --quick ≈ 16 min — 15 min 49 s end to end on 2026-12-07, all 17 passing —, indicative only). Each script writes its own result
# folder and its section of charts-data.md; a failed one is reported and the rest still run.
# Binaries from $LOKADB_BENCH_TARGET (default /work/target-bench/release), built beforehand:
#   CARGO_TARGET_DIR=/work/target-bench cargo build --release -p lokadb -p lokadb-agent -p lokadb-tests
set -u
cd "$(dirname "$0")/../.."
# research/bench/all.sh --render: runs nothing; draws every cited run's summary, charts and
# charts-data.md section again from its raw numbers (render.py --charts-data).
if [ "${1:-}" = "--render" ]; then
    exec .venv/bin/python research/bench/render.py --charts-data
fi
quick=()
[ "${1:-}" = "--quick" ] && quick=(--quick)
failed=()
for bench in run headline overload tunnel moves routing paths failures orgs clients django_app statement_org statement_org_wire cloud_tls metrics restart enable; do
    echo "=== $bench ${quick[*]} ($(date -u +%T))"
    if ! .venv/bin/python "research/bench/$bench.py" "${quick[@]}"; then
        failed+=("$bench")
    fi
done
echo "=== done ($(date -u +%T)); failed: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
