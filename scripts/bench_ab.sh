#!/usr/bin/env bash
# Compare two builds on one machine: the bench rows of checkout A and checkout B, alternated ROUNDS times
# (A, B, A, B, ...), then the median of each row per side and B/A (scripts/bench_ab_compare.py).
#
# Usage: bash scripts/bench_ab.sh A_CHECKOUT B_CHECKOUT [ROUNDS] [OUT]
# Each checkout needs its .venv with the library (and, where the bench lives there, the benchmarks) installed.
# Rows: same host paged, whole, small, calls; TCP paged, small (--repeat 3 each).
set -uo pipefail
A=$(cd "$1" && pwd); B=$(cd "$2" && pwd); ROUNDS=${3:-5}; OUT=${4:-$(mktemp -d)}
mkdir -p "$OUT"
for i in $(seq 1 "$ROUNDS"); do
  for side in a b; do
    if [ $side = a ]; then R=$A; else R=$B; fi
    (cd "$R" && .venv/bin/python -m aiodatadist bench paged whole small calls --transport shm --repeat 3 --quiet \
        --json "$OUT/$side-shm-$i.json" > "$OUT/$side-shm-$i.txt" 2>&1)
    (cd "$R" && .venv/bin/python -m aiodatadist bench paged small --transport tcp --repeat 3 --quiet \
        --json "$OUT/$side-tcp-$i.json" > "$OUT/$side-tcp-$i.txt" 2>&1)
    echo "round $i $side done" >&2
  done
done
"$A/.venv/bin/python" "$(dirname "$0")/bench_ab_compare.py" "$OUT"
